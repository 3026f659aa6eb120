"""The engine's device cache tensors, the host (swap) cache, and reusable staging buffers."""

from __future__ import annotations

import math
import queue
from collections.abc import Callable, Sequence
from typing import Any

from kvcore.ops import HostBuffer, describe_tensor
from kvcore.requests import DeviceBuffers, HostBuffers
from kvcore.schemas import CacheLayout

__all__ = ["DeviceCache", "HostCache", "StagingBuffer", "StagingPool", "tensor_ptr"]


def _check_layer_tensor(
    layout: CacheLayout, part: str, layer: int, t: Any
) -> tuple[tuple[int, ...], bool]:
    """Shape and placement of one layer's tensor, after checking it can hold the layout's blocks.

    A tensor of the wrong element size or bytes per block would be copied with the wrong
    stride: every block but the first would be silently wrong. So it is refused here, once.
    """
    name = f"{part}[{layer}]"
    _ptr, shape, itemsize, on_gpu = describe_tensor(t, name)  # refuses non-contiguous tensors
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
    return shape, on_gpu


def tensor_ptr(t: Any) -> int:
    """Address of a Paddle/torch tensor (``data_ptr()``) or a numpy array."""
    ptr = getattr(t, "data_ptr", None)
    if callable(ptr):
        return int(ptr())
    return int(t.ctypes.data)


class DeviceCache:
    """The engine's per-layer cache tensors, checked against the layout once.

    ``tensors[part][layer]``: one tensor per part (K, V, and for block-wise fp8 the K and V
    scales) and layer, contiguous, its first dimension the blocks. What a block holds inside is
    the engine's business (kvcore moves whole blocks): ``[heads, block_size, head_dim]`` as in
    FastDeploy, ``[block_size, heads, head_dim]`` as in vLLM, or flat. Checked: the element size
    is the layout dtype's (the scales' for scale parts), a block has the layout's bytes, every
    layer of a part has the same placement (CPU or GPU), and a main layer has
    ``layout.num_blocks`` blocks when the layout states it. Extra layers may have fewer blocks.
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
        placements = set()
        shapes: dict[str, list[tuple[int, ...]]] = {}
        for part, tensors in self.tensors.items():
            if len(tensors) != layout.total_layers:
                raise ValueError(
                    f"{part}: {len(tensors)} tensors for {layout.total_layers} layers "
                    f"({layout.num_layers} + {layout.num_extra_layers} extra)"
                )
            shapes[part] = []
            for layer, t in enumerate(tensors):
                shape, on_gpu = _check_layer_tensor(layout, part, layer, t)
                shapes[part].append(shape)
                placements.add(on_gpu)
        if len(placements) > 1:
            raise ValueError("the cache mixes CPU and GPU tensors; all must live on one device")
        self.on_gpu = placements.pop()
        for part in self.tensors:
            if [s[0] for s in shapes[part]] != [s[0] for s in shapes["k"]]:
                raise ValueError(f"{part}: block counts per layer differ from k's")
        self._shapes = shapes
        self.num_blocks = [s[0] for s in shapes["k"]]
        self.usable_blocks = min(self.num_blocks)
        self.ptrs = {part: tuple(tensor_ptr(t) for t in ts) for part, ts in self.tensors.items()}

    @property
    def parts(self) -> tuple[str, ...]:
        return self.layout.parts

    def block_shape(self, part: str) -> list[int]:
        """The first layer's tensor shape of ``part`` (``cache_shape`` of the swap ops)."""
        return list(self._shapes[part][0])

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


class HostCache:
    """The host swap space: per part and layer, ``num_blocks`` blocks laid out like the device."""

    def __init__(self, layout: CacheLayout, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.buffers = {
            part: [
                HostBuffer(num_blocks * layout.layer_block_bytes(part))
                for _ in range(layout.total_layers)
            ]
            for part in layout.parts
        }

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


class StagingBuffer:
    """One staging area: per part a region ``[slot, layer, head, block_size, head_dim]``."""

    def __init__(self, layout: CacheLayout, slots: int) -> None:
        self.slots = slots
        self.part_bytes = tuple(layout.part_bytes(p) for p in layout.parts)
        self.regions = [HostBuffer(slots * n) for n in self.part_bytes]
        for r in self.regions:  # fault the pages in now, not during the first request
            r.array.fill(0)

    def host_buffers(self, n: int, first_slot: int = 0) -> HostBuffers:
        """Buffers for slots ``first_slot .. first_slot + n - 1``."""
        if first_slot < 0 or first_slot + n > self.slots:
            raise ValueError(f"slots {first_slot}..{first_slot + n - 1} exceed {self.slots}")
        bases = [r.ptr + first_slot * s for r, s in zip(self.regions, self.part_bytes, strict=True)]
        return HostBuffers(
            ptrs=tuple(
                tuple(b + i * s for b, s in zip(bases, self.part_bytes, strict=True))
                for i in range(n)
            ),
            nbytes=self.part_bytes,
        )

    def close(self) -> None:
        for r in self.regions:
            r.close()


class StagingPool:
    """A fixed set of staging buffers handed out one per task and returned after the I/O.

    A buffer whose backend call overran its deadline is returned only when the call finally
    ends, so a late backend can never write into a buffer another task is using.
    """

    def __init__(self, layout: CacheLayout, slots: int, count: int) -> None:
        self.buffers = [StagingBuffer(layout, slots) for _ in range(count)]
        self._free: queue.Queue[StagingBuffer] = queue.Queue()
        for b in self.buffers:
            self._free.put(b)

    def acquire(self, timeout_s: float) -> StagingBuffer | None:
        try:
            if timeout_s <= 0:
                return self._free.get_nowait()
            return self._free.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def release(self, buf: StagingBuffer) -> None:
        self._free.put(buf)

    def regions(self) -> list[HostBuffer]:
        return [r for b in self.buffers for r in b.regions]

    def close(self, before_free: Callable[[HostBuffer], None] = lambda _r: None) -> int:
        """Free the buffers not in use; return how many are still leased.

        A leased buffer belongs to a backend call that overran and never returned: freeing it
        would let that call write into freed memory. It is left to the garbage collector,
        which frees it once the call (which references it) finally ends.
        """
        freed = 0
        while True:
            try:
                buf = self._free.get_nowait()
            except queue.Empty:
                break
            for region in buf.regions:
                before_free(region)
            buf.close()
            freed += 1
        return len(self.buffers) - freed
