"""Which host memory is registered with Mooncake, and on-the-fly registration for the rest.

Zero-copy transfers need registered memory (over RDMA the NIC must know the pages). The engine
announces its staging regions through ``kvcore_register_buffer``; a request whose buffers lie
outside them (e.g. the conformance kit's numpy arrays) gets a temporary registration of the
spans it touches, released when the call returns. Mooncake refuses a registration that
overlaps another (-600), so spans that cross an existing region are left unregistered: TCP
copies them anyway, RDMA fails them as a clean miss.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvcore.requests import merge_spans

__all__ = ["RegionTable", "merge_spans"]


@dataclass
class _Region:
    start: int
    end: int
    temporary: bool
    users: int = 0


@dataclass
class RegionTable:
    """Registered regions, sorted by start; registration calls go through ``register``."""

    register: Callable[[int, int], int]
    unregister: Callable[[int], int]
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _starts: list[int] = field(default_factory=list)
    _regions: list[_Region] = field(default_factory=list)

    # -- regions the engine announces -----------------------------------------------------

    def add(self, ptr: int, nbytes: int) -> int:
        """Register a long-lived region; returns Mooncake's code (0 on success)."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        with self._lock:
            if self._overlapping(ptr, ptr + nbytes):
                return -600  # Mooncake would refuse it too; say so without asking
            code = self.register(ptr, nbytes)
            if code == 0:
                self._insert(_Region(ptr, ptr + nbytes, temporary=False))
            return code

    def remove(self, ptr: int) -> int:
        """Unregister the long-lived region starting at ``ptr``; -600 when there is none."""
        with self._lock:
            i = bisect.bisect_left(self._starts, ptr)
            if i == len(self._starts) or self._starts[i] != ptr or self._regions[i].temporary:
                return -600
            del self._starts[i], self._regions[i]
            return self.unregister(ptr)

    def clear(self) -> None:
        """Forget every region without calling Mooncake (its client is being closed)."""
        with self._lock:
            self._starts.clear()
            self._regions.clear()

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._regions)

    # -- temporary registrations for one call ---------------------------------------------

    def pin(self, spans: Iterable[tuple[int, int]]) -> tuple[list[_Region], int]:
        """Make ``(start, end)`` spans registered for the duration of one call.

        Returns the temporary regions to pass to :meth:`unpin`, and how many spans had to stay
        unregistered (they overlap a region Mooncake already knows).
        """
        pinned: list[_Region] = []
        unregistered = 0
        with self._lock:
            for start, end in merge_spans(spans):
                hit = self._covering(start, end)
                if hit is not None:
                    if hit.temporary:
                        hit.users += 1
                        pinned.append(hit)
                    continue
                if self._overlapping(start, end) or self.register(start, end - start) != 0:
                    unregistered += 1
                    continue
                region = _Region(start, end, temporary=True, users=1)
                self._insert(region)
                pinned.append(region)
        return pinned, unregistered

    def unpin(self, pinned: list[_Region]) -> None:
        """Release what :meth:`pin` returned. A region :meth:`clear` forgot meanwhile (the
        client closed while the call was in flight: a tier stack abandons a call at its
        deadline and may close before it returns) is left to the closing client."""
        with self._lock:
            for region in pinned:
                region.users -= 1
                if region.users == 0:
                    i = bisect.bisect_left(self._starts, region.start)
                    while i < len(self._regions) and self._regions[i] is not region:
                        i += 1
                    if i == len(self._regions):
                        continue
                    del self._starts[i], self._regions[i]
                    self.unregister(region.start)

    # -- internals (lock held) ------------------------------------------------------------

    def _insert(self, region: _Region) -> None:
        i = bisect.bisect_right(self._starts, region.start)
        self._starts.insert(i, region.start)
        self._regions.insert(i, region)

    def _covering(self, start: int, end: int) -> _Region | None:
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0 and self._regions[i].end >= end:
            return self._regions[i]
        return None

    def _overlapping(self, start: int, end: int) -> bool:
        # regions are disjoint, so the last one starting before `end` reaches furthest
        i = bisect.bisect_left(self._starts, end)
        return i > 0 and self._regions[i - 1].end > start
