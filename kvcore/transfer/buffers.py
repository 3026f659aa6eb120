"""The engine's device cache tensors, the host (swap) cache, and reusable staging buffers."""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from typing import Any

from kvcore.ops import HostBuffer
from kvcore.requests import DeviceBuffers, HostBuffers
from kvcore.schemas import CacheLayout

__all__ = ["DeviceCache", "HostCache", "StagingBuffer", "StagingPool", "tensor_ptr"]


def tensor_ptr(t: Any) -> int:
    """Address of a Paddle/torch tensor (``data_ptr()``) or a numpy array."""
    ptr = getattr(t, "data_ptr", None)
    if callable(ptr):
        return int(ptr())
    return int(t.ctypes.data)


class DeviceCache:
    """The engine's per-layer cache tensors, checked against the layout once.

    ``tensors[part][layer]``: K and V are ``[num_blocks, heads, block_size, head_dim]`` and the
    scales ``[num_blocks, heads, block_size]``; extra layers may have their own block count.
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
        for part, tensors in self.tensors.items():
            if len(tensors) != layout.total_layers:
                raise ValueError(
                    f"{part}: {len(tensors)} tensors for {layout.total_layers} layers "
                    f"({layout.num_layers} + {layout.num_extra_layers} extra)"
                )
            block_shape = layout.kv_block_shape if part in ("k", "v") else layout.scale_block_shape
            for layer, t in enumerate(tensors):
                shape = tuple(int(s) for s in t.shape)
                if shape[1:] != block_shape:
                    raise ValueError(
                        f"{part}[{layer}] has shape {list(shape)}; blocks of the layout are "
                        f"{list(block_shape)}"
                    )
        self.num_blocks = [int(t.shape[0]) for t in self.tensors["k"]]
        self.usable_blocks = min(self.num_blocks)
        self.ptrs = {part: tuple(tensor_ptr(t) for t in ts) for part, ts in self.tensors.items()}

    @property
    def parts(self) -> tuple[str, ...]:
        return self.layout.parts

    def block_shape(self, part: str) -> list[int]:
        lay = self.layout
        shape = lay.kv_block_shape if part in ("k", "v") else lay.scale_block_shape
        return [self.num_blocks[0], *shape]

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
