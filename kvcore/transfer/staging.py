"""Reusable host staging buffers: where blocks wait between the device cache and a backend."""

from __future__ import annotations

import queue
from collections.abc import Callable

from kvcore.ops import HostBuffer
from kvcore.requests import HostBuffers
from kvcore.schemas import CacheLayout

__all__ = ["StagingBuffer", "StagingPool"]


class StagingBuffer:
    """One task's staging area: per part a region ``[slot, layer, *block]`` of ``slots`` slots.

    Pages are touched only when ``prefault`` is set; otherwise the first task pays for them
    (the memory an engine never uses is never committed).
    """

    def __init__(self, layout: CacheLayout, slots: int, prefault: bool = False) -> None:
        self.slots = slots
        self.part_bytes = tuple(layout.part_bytes(p) for p in layout.parts)
        self.regions = [HostBuffer(slots * n) for n in self.part_bytes]
        self.addresses = tuple(r.ptr for r in self.regions)
        if prefault:
            for r in self.regions:
                r.array.fill(0)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    def host_buffers(self, n: int, first_slot: int = 0) -> HostBuffers:
        """Buffers for slots ``first_slot .. first_slot + n - 1``."""
        if first_slot < 0 or first_slot + n > self.slots:
            raise ValueError(f"slots {first_slot}..{first_slot + n - 1} exceed {self.slots}")
        sizes = self.part_bytes
        bases = [a + first_slot * s for a, s in zip(self.addresses, sizes, strict=True)]
        return HostBuffers(
            ptrs=tuple(
                tuple(b + i * s for b, s in zip(bases, sizes, strict=True)) for i in range(n)
            ),
            nbytes=sizes,
        )

    def close(self) -> None:
        for r in self.regions:
            r.close()


class StagingPool:
    """A fixed set of staging buffers handed out one per task and returned after the I/O.

    A buffer whose backend call overran its deadline is returned only when the call finally
    ends, so a late backend can never write into a buffer another task is using.
    """

    def __init__(self, layout: CacheLayout, slots: int, count: int, prefault: bool = False):
        self.buffers = [StagingBuffer(layout, slots, prefault) for _ in range(count)]
        self._free: queue.Queue[StagingBuffer] = queue.Queue()
        for b in self.buffers:
            self._free.put(b)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

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
