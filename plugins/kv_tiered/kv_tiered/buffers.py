"""Host buffers of the stack's own: for background copies, and for writes into a tier that
may run on after the caller returned (:mod:`kv_tiered.bounded`).

Their memory is reused. A fresh mapping costs its page faults when first written: copying
117 MB into a new mapping took 105 ms here, into memory already touched 12 ms. So a region
whose last user let go goes back to a pool (bounded in bytes) and the next copy of that size
takes it; a new one is mapped populated (half the cost of faulting page by page).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Sequence

from kvcore import HostBuffers

__all__ = ["POOL_BYTES", "Region", "own_buffers", "private_copy"]

_PAGE = mmap.PAGESIZE
#: bytes of idle regions kept for reuse, resident in the process (more are unmapped when their
#: last user lets go)
POOL_BYTES = 256 << 20
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)

_pool_lock = threading.Lock()
_pool: dict[int, list[mmap.mmap]] = {}
_pool_bytes = 0


class Region:
    """One mapping, held by whoever reads or writes its buffers; when the last holder lets
    go, the mapping goes back to the pool (or is unmapped when the pool is full)."""

    __slots__ = ("_map", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        with _pool_lock:
            free = _pool.get(nbytes)
            self._map = free.pop() if free else None
            if self._map is not None:
                global _pool_bytes
                _pool_bytes -= nbytes
        if self._map is None:
            self._map = mmap.mmap(-1, nbytes, flags=_MAP_FLAGS)

    @property
    def base(self) -> int:
        assert self._map is not None
        return ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def __del__(self) -> None:
        global _pool_bytes
        region = self._map
        if region is None:
            return
        self._map = None
        with _pool_lock:
            if _pool_bytes + self.nbytes <= POOL_BYTES:
                _pool.setdefault(self.nbytes, []).append(region)
                _pool_bytes += self.nbytes
                return
        region.close()


def own_buffers(blocks: int, sizes: Sequence[int]) -> tuple[HostBuffers, Region]:
    """Page-aligned regions for ``blocks`` objects of each part size (direct I/O takes them);
    the regions live as long as the returned :class:`Region` is held."""
    slots = [-(-s // _PAGE) * _PAGE for s in sizes]
    stride = sum(slots)
    region = Region(max(_PAGE, blocks * stride))
    base = region.base
    offsets = [sum(slots[:j]) for j in range(len(slots))]
    ptrs = tuple(tuple(base + i * stride + o for o in offsets) for i in range(blocks))
    return HostBuffers(ptrs, tuple(sizes)), region


def private_copy(host: HostBuffers) -> tuple[HostBuffers, Region]:
    """A copy of ``host``'s bytes (segmented or not) in buffers of the stack's own."""
    parts = len(host.nbytes)
    copy, region = own_buffers(host.num_blocks, host.nbytes)
    for i in range(host.num_blocks):
        for j in range(parts):
            target = copy.views(i, j)[0]
            at = 0
            for view in host.views(i, j):
                target[at : at + len(view)] = view
                at += len(view)
    return copy, region
