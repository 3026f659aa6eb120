"""The engine's cache tensors (described once) and the host swap cache."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcore import ops
from kvcore.requests import DeviceBuffers, HostBuffers, merge_spans
from kvcore.schemas import CacheLayout

__all__ = ["DeviceCache", "HostCache"]


class DeviceCache:
    """The engine's per-layer cache tensors, checked against the layout once.

    ``tensors[part][layer]``: one tensor per part (K, V, and for block-wise fp8 the K and V
    scales) and layer, contiguous, its first dimension the blocks. What a block holds inside is
    the engine's business (kvcore moves whole blocks): ``[heads, block_size, head_dim]`` as in
    FastDeploy, ``[block_size, heads, head_dim]`` as in vLLM, or flat. Checked: the element size
    is the layout dtype's (the scales' for scale parts), a block has the layout's bytes, every
    tensor lives on one device (the CPU, or a GPU), and a main layer has ``layout.num_blocks``
    blocks when the layout states it. Extra layers may have fewer blocks.

    Tensors may be Paddle, torch or CuPy tensors or numpy arrays. The cache keeps them alive and
    describes them once for the swap ops (:attr:`layers`).
    """

    def __init__(
        self,
        layout: CacheLayout,
        k: Sequence[Any],
        v: Sequence[Any],
        k_scale: Sequence[Any] | None = None,
        v_scale: Sequence[Any] | None = None,
    ) -> None:
        self.layout = layout
        self.tensors: dict[str, list[Any]] = {"k": list(k), "v": list(v)}
        if layout.dtype.has_scales:
            if k_scale is None or v_scale is None:
                raise ValueError(f"layout dtype {layout.dtype.value} needs k_scale and v_scale")
            self.tensors["k_scale"], self.tensors["v_scale"] = list(k_scale), list(v_scale)
        elif k_scale is not None or v_scale is not None:
            raise ValueError(
                f"k_scale/v_scale given, but layout dtype {layout.dtype.value} has no scales"
            )
        for part, tensors in self.tensors.items():
            if len(tensors) != layout.total_layers:
                raise ValueError(
                    f"{part}: {len(tensors)} tensors for {layout.total_layers} layers "
                    f"({layout.num_layers} + {layout.num_extra_layers} extra)"
                )
            for layer, t in enumerate(tensors):
                _check_layer_tensor(layout, part, layer, t)
        #: per part, the layers as the swap ops take them (described once, trusted afterwards)
        self.layers = {part: ops.describe_layers(ts, part) for part, ts in self.tensors.items()}
        placements = {ls.on_gpu for ls in self.layers.values()}
        if len(placements) > 1:
            raise ValueError("the cache mixes CPU and GPU tensors; all must live on one device")
        self.on_gpu: bool = placements.pop()
        self.num_blocks = [int(n) for n in self.layers["k"].nblocks]
        for part, ls in self.layers.items():
            if [int(n) for n in ls.nblocks] != self.num_blocks:
                raise ValueError(f"{part}: block counts per layer differ from k's")
        self.usable_blocks = min(self.num_blocks)
        self.ptrs = {part: tuple(int(p) for p in ls.ptrs) for part, ls in self.layers.items()}
        self._layer_views: tuple[tuple[memoryview, ...], ...] | None = None

    @property
    def parts(self) -> tuple[str, ...]:
        return self.layout.parts

    def block_shape(self, part: str) -> list[int]:
        """The first layer's tensor shape of ``part`` (``cache_shape`` of the swap ops)."""
        ls = self.layers[part]
        return [int(ls.nblocks[0]), *ls.block_shape]

    def check_ids(self, ids: Sequence[int], field: str) -> None:
        for i, b in enumerate(ids):
            if not 0 <= b < self.usable_blocks:
                raise ValueError(
                    f"{field}[{i}] = {b} is outside the device cache (0 <= id < "
                    f"{self.usable_blocks} in every layer)"
                )

    def device_buffers(self, block_ids: Sequence[int], device_id: int) -> DeviceBuffers:
        lay = self.layout
        return DeviceBuffers(
            layout=lay,
            layer_ids=tuple(range(lay.total_layers)),
            k_ptrs=self.ptrs["k"],
            v_ptrs=self.ptrs["v"],
            k_scale_ptrs=self.ptrs.get("k_scale", ()),
            v_scale_ptrs=self.ptrs.get("v_scale", ()),
            block_ids=tuple(block_ids),
            device_id=device_id,
        )

    def host_buffers(self, block_ids: Sequence[int]) -> HostBuffers:
        """The blocks themselves as segmented host buffers (one segment per layer and part):
        a backend reads into and writes from them in place. Host-resident caches only."""
        if self.on_gpu:
            raise ValueError("GPU-resident blocks cannot be host buffers")
        parts = self.layout.parts
        if self._layer_views is None:  # once per cache: a view per layer, sliced per object
            self._layer_views = tuple(
                tuple(
                    memoryview((ctypes.c_char * int(n * ls.block_bytes)).from_address(int(p))).cast(
                        "B"
                    )
                    for p, n in zip(ls.ptrs, ls.nblocks, strict=True)
                )
                for ls in (self.layers[part] for part in parts)
            )
        return HostBuffers(
            ptrs=(),
            nbytes=tuple(self.layout.part_bytes(p) for p in parts),
            layer_ptrs=tuple(self.ptrs[p] for p in parts),
            block_ids=tuple(block_ids),
            segment_nbytes=tuple(self.layout.layer_block_bytes(p) for p in parts),
            layer_views=self._layer_views,
        )

    def host_regions(self) -> list[tuple[int, int]]:
        """The memory of every layer of every part, as disjoint ``(ptr, nbytes)`` regions
        (views of one allocation merge into one): what a zero-copy backend registers."""
        spans = (
            (int(p), int(p) + int(n) * int(ls.block_bytes))
            for ls in self.layers.values()
            for p, n in zip(ls.ptrs, ls.nblocks, strict=True)
        )
        return [(start, end - start) for start, end in merge_spans(spans)]

    def copy_to_staging(
        self,
        staging: Sequence[int],
        ids: np.ndarray,
        first_slot: int,
        nslots: int,
        device_id: int,
        mode: int,
    ) -> None:
        """Gather (mode 0) blocks ``ids`` into consecutive slots from ``first_slot`` of each
        part's staging region (``staging[j]``, ``nslots`` slots), or scatter them back (1)."""
        slots = np.arange(first_slot, first_slot + len(ids), dtype=np.int64)
        for part, region in zip(self.layout.parts, staging, strict=True):
            ops.copy_blocks(self.layers[part], region, nslots, ids, slots, device_id, mode)


def _check_layer_tensor(layout: CacheLayout, part: str, layer: int, t: Any) -> None:
    """Check one layer's tensor can hold the layout's blocks.

    A tensor of the wrong element size or bytes per block would be copied with the wrong
    stride: every block but the first would be silently wrong. So it is refused here, once.
    """
    name = f"{part}[{layer}]"
    _ptr, shape, itemsize, _on_gpu = ops.describe_tensor(t, name)  # refuses non-contiguous
    want_item = layout.part_itemsize(part)
    kind = layout.dtype.value if part in ("k", "v") else f"{layout.scale_dtype} scale"
    if itemsize != want_item:
        raise ValueError(
            f"{name} has {itemsize}-byte elements; the layout's {kind} elements are {want_item} "
            f"bytes (dtype {getattr(t, 'dtype', '?')})"
        )
    if len(shape) < 2:
        raise ValueError(f"{name} has shape {list(shape)}; expected [num_blocks, ...]")
    block_bytes = math.prod(shape[1:]) * itemsize
    want_block = layout.layer_block_bytes(part)
    if block_bytes != want_block:
        want_shape = layout.kv_block_shape if part in ("k", "v") else layout.scale_block_shape
        raise ValueError(
            f"{name} has shape {list(shape)}: {block_bytes} bytes per block; blocks of the layout "
            f"are {list(want_shape)} x {want_item} bytes = {want_block} bytes"
        )
    if layout.num_blocks and shape[0] != layout.layer_num_blocks(layer):
        raise ValueError(
            f"{name} holds {shape[0]} blocks; the layout says {layout.layer_num_blocks(layer)}"
        )


class HostCache:
    """The host swap space: per part and layer, ``num_blocks`` blocks laid out like the device."""

    def __init__(self, layout: CacheLayout, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.buffers = {
            part: [
                ops.HostBuffer(num_blocks * layout.layer_block_bytes(part))
                for _ in range(layout.total_layers)
            ]
            for part in layout.parts
        }
        self.ptrs = {
            part: np.asarray([b.ptr for b in bufs], dtype=np.uint64)
            for part, bufs in self.buffers.items()
        }

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for bufs in self.buffers.values() for b in bufs)

    def swap(
        self,
        cache: DeviceCache,
        dev_ids: np.ndarray,
        host_ids: np.ndarray,
        device_id: int,
        mode: int,
    ) -> None:
        """Copy blocks ``dev_ids`` of ``cache`` to host blocks ``host_ids`` (mode 0) or back."""
        for part in self.layout.parts:
            layers = cache.layers[part]
            ptrs = self.ptrs[part]
            ops.copy_blocks(layers, ptrs, self.num_blocks, dev_ids, host_ids, device_id, mode)

    def check_ids(self, ids: Sequence[int], field: str) -> None:
        for i, b in enumerate(ids):
            if not 0 <= b < self.num_blocks:
                raise ValueError(
                    f"{field}[{i}] = {b} is outside the host cache (0..{self.num_blocks - 1})"
                )

    def close(self) -> None:
        for bufs in self.buffers.values():
            for b in bufs:
                b.close()
