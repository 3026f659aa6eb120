"""Host buffers of the stack's own: for background copies, and for writes into a tier that
may run on after the caller returned (:mod:`kv_tiered.bounded`)."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence

from kvcore import HostBuffers

__all__ = ["own_buffers", "private_copy"]

_PAGE = mmap.PAGESIZE


def own_buffers(blocks: int, sizes: Sequence[int]) -> tuple[HostBuffers, mmap.mmap]:
    """Page-aligned regions for ``blocks`` objects of each part size (direct I/O takes them);
    the regions live as long as the returned mmap."""
    slots = [-(-s // _PAGE) * _PAGE for s in sizes]
    stride = sum(slots)
    region = mmap.mmap(-1, max(1, blocks * stride))
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offsets = [sum(slots[:j]) for j in range(len(slots))]
    ptrs = tuple(tuple(base + i * stride + o for o in offsets) for i in range(blocks))
    return HostBuffers(ptrs, tuple(sizes)), region


def private_copy(host: HostBuffers) -> tuple[HostBuffers, mmap.mmap]:
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
