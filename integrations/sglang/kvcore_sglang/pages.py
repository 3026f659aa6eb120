"""SGLang host-pool pages as kvcore blocks: what one page's objects are, and where their bytes lie.

One SGLang page is one kvcore block, keyed by SGLang's page hash. Its *parts* (kvcore objects)
are what the host pool's ``get_page_buffer_meta`` describes for it:

- MHA: a K part and a V part; MLA: one latent part; a side pool (v2 API, e.g. Mamba): one
  part per region the pool reports for a page (temporal state, each conv state).
- Layouts whose page part is one region (``page_first``, ``page_first_direct``, ``page_head``)
  are read and written **in place**: kvcore gets the pool's own addresses.
- ``layer_first`` reports one region per layer and part. A backend that takes segmented host
  buffers (``Capabilities.segmented_host``) gets the per-layer segments as they are (still in
  place); any other backend gets them gathered into a staging area on write and scattered
  back on read (one copy, vectorised over the batch).

The stored bytes of a part are its regions concatenated in ``get_page_buffer_meta`` order, so
the legacy API's flat page (``get_data_page(..., flat=True)``, K then V) holds exactly the same
bytes as the v1 API's objects. The byte order inside a part follows the layout: token-major
``[page, layer, ...]`` for ``page_first`` ("tm"), layer-major ``[layer, page, ...]`` for
``layer_first`` and ``page_first_direct`` ("lm": the two store identical bytes and share
pages), head-major for ``page_head`` ("hm"). The order, the attention kind and the dtype end the
namespace, so a pool never reads bytes laid out for another.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kvcore

__all__ = [
    "ORDER_TAGS",
    "PageFormat",
    "Staging",
    "aligned_bytes",
    "describe_pool",
    "kv_cache_layout",
    "page_buffers",
    "pointer_buffers",
    "tensor_buffers",
]

#: Byte order of a page part per SGLang host layout (layouts missing here use their own name).
ORDER_TAGS = {
    "page_first": "tm",
    "layer_first": "lm",
    "page_first_direct": "lm",
    "page_head": "hm",
}

_PAGE = 4096  # alignment of staging memory: kv_file reads cold objects with O_DIRECT
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.uint8: "uint8"}


@dataclass(frozen=True)
class PageFormat:
    """How one page of one host pool is stored."""

    layout: str
    parts: tuple[str, ...]
    part_nbytes: tuple[int, ...]
    #: regions per part in ``get_page_buffer_meta`` (1: the part is one region; >1: per layer)
    segments: int
    segment_nbytes: tuple[int, ...]
    page_size: int
    #: ends the namespace: attention kind, byte order, dtype (e.g. ``mha-tm-bfloat16``)
    tag: str
    #: per part, per segment: the address of page 0's segment (only when ``segments > 1``)
    base_ptrs: tuple[tuple[int, ...], ...] | None = None

    @property
    def regions(self) -> int:
        """Regions ``get_page_buffer_meta`` reports per page."""
        return len(self.parts) * self.segments

    @property
    def page_nbytes(self) -> int:
        return sum(self.part_nbytes)


def describe_pool(pool: Any, parts: Sequence[str], kind: str) -> PageFormat:
    """The page format of ``pool`` with ``parts`` per page (regions interleave part-fastest).

    Probes ``get_page_buffer_meta`` with the pool's first page; every part must consist of
    equally sized regions. Raises ValueError naming the pool and what did not fit.
    """
    page = int(pool.page_size)
    name = f"{type(pool).__name__}(layout={getattr(pool, 'layout', '?')!r})"
    try:
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
    except Exception as exc:
        raise ValueError(
            f"{name}: get_page_buffer_meta failed ({type(exc).__name__}: {exc}); kvcore "
            "stores pages only through it"
        ) from None
    nparts = len(parts)
    if not ptrs or len(ptrs) != len(sizes) or len(ptrs) % nparts:
        raise ValueError(
            f"{name}: get_page_buffer_meta gave {len(ptrs)} regions for one page; expected a "
            f"multiple of the {nparts} part(s) {tuple(parts)}"
        )
    segments = len(ptrs) // nparts
    segment_nbytes = []
    for j in range(nparts):
        own = {int(sizes[s * nparts + j]) for s in range(segments)}
        if len(own) != 1 or min(own) <= 0:
            raise ValueError(f"{name}: part {parts[j]!r} has regions of sizes {sorted(own)}")
        segment_nbytes.append(own.pop())
    base = None
    if segments > 1:
        base = tuple(
            tuple(int(ptrs[s * nparts + j]) for s in range(segments)) for j in range(nparts)
        )
    layout = str(getattr(pool, "layout", "unknown"))
    dtype = str(getattr(pool, "dtype", "bytes")).removeprefix("torch.")
    return PageFormat(
        layout=layout,
        parts=tuple(parts),
        part_nbytes=tuple(n * segments for n in segment_nbytes),
        segments=segments,
        segment_nbytes=tuple(segment_nbytes),
        page_size=page,
        tag=f"{kind}-{ORDER_TAGS.get(layout, layout)}-{dtype}",
        base_ptrs=base,
    )


def kv_cache_layout(pool: Any, fmt: PageFormat) -> kvcore.CacheLayout | None:
    """A :class:`kvcore.CacheLayout` whose ``part_bytes`` is ``fmt``'s bytes per K/V part.

    An MHA page part holds ``layers x heads x page_size x head_dim`` elements, so the layout is
    the host pool's geometry with ``block_size = page_size``. A dtype kvcore does not name (fp8,
    float32) becomes bytes: one layer, one head, one token, ``head_dim`` = the part's bytes.
    None when K and V differ in size (no layout can say so; kvcore then checks no sizes).
    """
    if len(fmt.parts) != 2 or fmt.part_nbytes[0] != fmt.part_nbytes[1]:
        return None
    want = fmt.part_nbytes[0]
    dtype = _DTYPES.get(getattr(pool, "dtype", None))
    geometry = (
        getattr(pool, "layer_num", 0),
        getattr(pool, "head_num", 0),
        getattr(pool, "head_dim", 0),
    )
    if dtype is not None and all(isinstance(g, int) and g > 0 for g in geometry):
        layout = kvcore.CacheLayout(
            num_layers=geometry[0],
            num_heads=geometry[1],
            block_size=fmt.page_size,
            head_dim=geometry[2],
            dtype=dtype,
        )
        if layout.part_bytes("k") == want:
            return layout
    return kvcore.CacheLayout(num_layers=1, num_heads=1, block_size=1, head_dim=want, dtype="uint8")


def aligned_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` uninitialised bytes starting on a 4 KiB boundary (a view keeps them alive)."""
    raw = np.empty(nbytes + _PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % _PAGE
    return raw[start : start + nbytes]


def _page_meta(pool: Any, fmt: PageFormat, host_indices: Any, n_pages: int) -> list[int]:
    if isinstance(host_indices, torch.Tensor) and host_indices.device.type != "cpu":
        host_indices = host_indices.cpu()
    ptrs, _ = pool.get_page_buffer_meta(host_indices)
    if len(ptrs) != n_pages * fmt.regions:
        raise ValueError(
            f"host_indices ({len(host_indices)} slots) describe {len(ptrs) // fmt.regions} "
            f"pages of {fmt.page_size} tokens but {n_pages} keys were given"
        )
    return [int(p) for p in ptrs]


def page_buffers(
    pool: Any, fmt: PageFormat, host_indices: Any, n_pages: int, *, segmented_ok: bool
) -> tuple[kvcore.HostBuffers, Staging | None]:
    """kvcore host buffers for ``n_pages`` pages at ``host_indices`` of ``pool``.

    Returns the buffers and, when the pages had to be staged, the :class:`Staging` that holds
    them (call :meth:`Staging.gather` before a write, :meth:`Staging.scatter` after a read).
    """
    ptrs = _page_meta(pool, fmt, host_indices, n_pages)
    per_page = fmt.regions
    if fmt.segments == 1:
        blocks = tuple(tuple(ptrs[i * per_page : (i + 1) * per_page]) for i in range(n_pages))
        return kvcore.HostBuffers(blocks, fmt.part_nbytes), None
    if segmented_ok:
        block_ids = _segment_block_ids(fmt, ptrs, n_pages)
        if block_ids is not None:
            assert fmt.base_ptrs is not None
            return (
                kvcore.HostBuffers(
                    (),
                    fmt.part_nbytes,
                    layer_ptrs=fmt.base_ptrs,
                    block_ids=block_ids,
                    segment_nbytes=fmt.segment_nbytes,
                ),
                None,
            )
    staging = Staging(fmt, ptrs, n_pages)
    return staging.buffers, staging


def _segment_block_ids(fmt: PageFormat, ptrs: list[int], n_pages: int) -> tuple[int, ...] | None:
    """Block ids that place every region of every page at ``base + id * segment`` (kvcore's
    segmented form), or None when the regions do not follow that rule (unaligned pages)."""
    assert fmt.base_ptrs is not None
    nparts, segs = len(fmt.parts), fmt.segments
    got = np.asarray(ptrs, dtype=np.int64).reshape(n_pages, segs, nparts)
    base = np.asarray(fmt.base_ptrs, dtype=np.int64).T  # [segment, part]
    size = np.asarray(fmt.segment_nbytes, dtype=np.int64)  # [part]
    offset = got[:, 0, 0] - base[0, 0]
    if np.any(offset < 0) or np.any(offset % size[0]):
        return None
    ids = offset // size[0]
    expected = base[None, :, :] + ids[:, None, None] * size[None, None, :]
    if not np.array_equal(got, expected):
        return None
    return tuple(int(i) for i in ids)


class Staging:
    """Pages gathered into one aligned buffer: page ``i``'s part ``j`` is contiguous.

    Used for per-layer regions when the backend takes only contiguous objects. With equal
    region sizes at region-aligned offsets (SGLang's layer_first pools with page-aligned
    indices) the gather and the scatter are one vectorised numpy copy each; otherwise one
    ``memmove`` per region.
    """

    def __init__(self, fmt: PageFormat, ptrs: list[int], n_pages: int) -> None:
        self.fmt = fmt
        self.n_pages = n_pages
        self.memory = aligned_bytes(max(1, n_pages * fmt.page_nbytes))
        start = self.memory.ctypes.data
        offsets = np.cumsum((0, *fmt.part_nbytes[:-1]))
        self.buffers = kvcore.HostBuffers(
            tuple(
                tuple(int(start + i * fmt.page_nbytes + o) for o in offsets) for i in range(n_pages)
            ),
            fmt.part_nbytes,
        )
        nparts, segs = len(fmt.parts), fmt.segments
        # region pointers in staging order: page, part, segment
        self._regions = (
            np.asarray(ptrs, dtype=np.int64).reshape(n_pages, segs, nparts).transpose(0, 2, 1)
        )
        self._rows: tuple[np.ndarray, np.ndarray] | None = self._row_view()

    def _row_view(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows of the pool memory the batch touches, row index per region), or None."""
        sizes = set(self.fmt.segment_nbytes)
        if len(sizes) != 1 or self.n_pages == 0:
            return None
        size = sizes.pop()
        low = int(self._regions.min())
        span = int(self._regions.max()) - low + size
        if np.any((self._regions - low) % size):
            return None
        memory = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(low))
        return memory.reshape(span // size, size), ((self._regions - low) // size).reshape(-1)

    def _staged_rows(self, pages: int) -> np.ndarray:
        size = self.fmt.segment_nbytes[0]
        return self.memory[: pages * self.fmt.page_nbytes].reshape(-1, size)

    def gather(self) -> None:
        """Copy the pages' regions from the pool into the staging memory."""
        if self._rows is not None:
            rows, index = self._rows
            # mode="clip": with the default mode numpy gathers into a temporary first
            np.take(rows, index, axis=0, out=self._staged_rows(self.n_pages), mode="clip")
            return
        self._copy(self.n_pages, to_pool=False)

    def scatter(self, pages: int) -> None:
        """Copy the first ``pages`` staged pages back into the pool's regions."""
        pages = min(pages, self.n_pages)
        if pages <= 0:
            return
        if self._rows is not None:
            rows, index = self._rows
            count = pages * len(self.fmt.parts) * self.fmt.segments
            rows[index[:count]] = self._staged_rows(pages)
            return
        self._copy(pages, to_pool=True)

    def _copy(self, pages: int, *, to_pool: bool) -> None:
        fmt = self.fmt
        for i in range(pages):
            for j, part_ptr in enumerate(self.buffers.ptrs[i]):
                size = fmt.segment_nbytes[j]
                for s in range(fmt.segments):
                    pool_ptr = int(self._regions[i, j, s])
                    staged = part_ptr + s * size
                    if to_pool:
                        ctypes.memmove(pool_ptr, staged, size)
                    else:
                        ctypes.memmove(staged, pool_ptr, size)


def tensor_buffers(fmt: PageFormat, tensors: Sequence[torch.Tensor]) -> kvcore.HostBuffers:
    """Host buffers over flat pages (``get_data_page(..., flat=True)``), parts back to back.

    Each tensor must be a contiguous CPU tensor of exactly one page's bytes.
    """
    offsets = np.cumsum((0, *fmt.part_nbytes[:-1]))
    blocks = []
    for i, tensor in enumerate(tensors):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != fmt.page_nbytes or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(
                f"page {i}: a contiguous CPU tensor of {fmt.page_nbytes} bytes is needed, got "
                f"{nbytes} bytes on {tensor.device} (contiguous={tensor.is_contiguous()})"
            )
        start = tensor.data_ptr()
        blocks.append(tuple(int(start + o) for o in offsets))
    return kvcore.HostBuffers(tuple(blocks), fmt.part_nbytes)


def pointer_buffers(
    fmt: PageFormat, locations: Sequence[Any], sizes: Sequence[Any]
) -> kvcore.HostBuffers:
    """Host buffers from raw addresses (the legacy zero-copy calling convention).

    ``locations[i]`` is one address (a whole flat page, parts back to back) or one address per
    part; ``sizes[i]`` the matching byte count(s).
    """
    blocks = []
    offsets = np.cumsum((0, *fmt.part_nbytes[:-1]))
    for i, (loc, size) in enumerate(zip(locations, sizes, strict=True)):
        if isinstance(loc, (list, tuple)):
            got = tuple(int(s) for s in size)
            if len(loc) != len(fmt.parts) or got != fmt.part_nbytes:
                raise ValueError(
                    f"page {i}: {len(loc)} regions of {list(got)} bytes; expected "
                    f"{list(fmt.part_nbytes)} (parts {list(fmt.parts)})"
                )
            blocks.append(tuple(int(p) for p in loc))
        else:
            if int(size) != fmt.page_nbytes:
                raise ValueError(f"page {i}: {int(size)} bytes; one page is {fmt.page_nbytes}")
            blocks.append(tuple(int(loc) + int(o) for o in offsets))
    return kvcore.HostBuffers(tuple(blocks), fmt.part_nbytes)
