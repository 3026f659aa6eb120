"""Reference backends for the core's tests: the published ``memory`` backend, and a
token-addressed, device-I/O one that only tests need."""

from __future__ import annotations

import ctypes

import kvcore
from kvcore import BlockRequest
from kvcore.memory_backend import MemoryBackend, MemoryConfig

__all__ = ["DeviceMemoryBackend", "MemoryBackend", "MemoryConfig"]


class DeviceMemoryBackend:
    """A token-addressed, device-I/O reference: copies blocks straight from/to layer tensors."""

    config_model = MemoryConfig
    capabilities = kvcore.Capabilities(addressing="token", io="device", token_index=True)

    def __init__(self, config: MemoryConfig, context: kvcore.BackendContext) -> None:
        self._blocks: dict[tuple[str, str], bytes] = {}
        self.flushes: list[tuple[int, int, bool]] = []

    def _parts(self, dev):
        lay = dev.layout
        yield "k", dev.k_ptrs, lay.kv_layer_block_bytes
        yield "v", dev.v_ptrs, lay.kv_layer_block_bytes
        if dev.k_scale_ptrs:
            yield "k_scale", dev.k_scale_ptrs, lay.scale_layer_block_bytes
            yield "v_scale", dev.v_scale_ptrs, lay.scale_layer_block_bytes

    @kvcore.hookimpl
    def kvcore_query(self, request: BlockRequest) -> int:
        n = 0
        for key in request.block_keys:
            if (key, "k") not in self._blocks:
                break
            n += 1
        return n

    @kvcore.hookimpl
    def kvcore_write(self, request: BlockRequest) -> int:
        dev = request.device
        for i, key in enumerate(request.block_keys):
            b = dev.block_ids[i]
            for part, ptrs, size in self._parts(dev):
                self._blocks[(key, part)] = b"".join(
                    ctypes.string_at(p + b * size, size) for p in ptrs
                )
        return request.num_blocks

    @kvcore.hookimpl
    def kvcore_read(self, request: BlockRequest) -> int:
        dev = request.device
        for i, key in enumerate(request.block_keys):
            b = dev.block_ids[i]
            for part, ptrs, size in self._parts(dev):
                data = self._blocks.get((key, part))
                if data is None:
                    return i
                for layer, p in enumerate(ptrs):
                    ctypes.memmove(p + b * size, data[layer * size : (layer + 1) * size], size)
        return request.num_blocks

    @kvcore.hookimpl
    def kvcore_flush_token_index(self, request: BlockRequest, resident_on_device: bool) -> int:
        self.flushes.append((request.start_block, request.num_blocks, resident_on_device))
        return request.num_blocks
