"""A request's object files read or written as one native batch (:mod:`kvcore.fileio`).

The per-object work of :func:`kv_file.objio.read_object` and :func:`~kv_file.objio.write_object`
(open, one vectored call for header and payload, the checksum, the header's checks, the
rename) runs in native code for the whole batch, on as many of the backend's threads as the
batch should use, with no Python step per object. What a batch cannot settle (a file that is
not what its name promises, direct reads refused) goes back to ``objio``'s own per-object
code, which classifies and removes it: one place decides what a wrong file is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kv_file import objio
from kv_file.objfile import DIGEST_AT, HEAD_COMPARE_MASK, head_fields, header_size, header_template
from kvcore import fileio

__all__ = ["Rows", "enabled", "read_objects", "write_objects"]


def enabled() -> bool:
    """Whether reads and writes go through native batches: kvcore's native file I/O is on
    (``KVCORE_NATIVE_IO``) and computes checksums."""
    return objio.native_io and fileio.NATIVE_DIGESTS


class Rows:
    """The pieces of some objects of a request: ``(address, nbytes)`` rows and where each
    object's start (see :meth:`kvcore.HostBuffers.iovecs`)."""

    __slots__ = ("rows", "starts")

    def __init__(self, rows: npt.NDArray[np.int64], starts: npt.NDArray[np.int64]) -> None:
        self.rows = rows
        self.starts = starts

    def take(self, objects: npt.NDArray[np.int64]) -> Rows:
        """The rows of ``objects`` (indices, ascending), in that order."""
        if len(objects) == len(self.starts) - 1:
            return self  # every object: the same rows
        first = self.starts[objects]
        counts = self.starts[objects + 1] - first
        starts = np.zeros(len(objects) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        picked = np.repeat(first - starts[:-1], counts) + np.arange(starts[-1], dtype=np.int64)
        return Rows(self.rows[picked], starts)


def group_starts(blocks: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """For objects in order whose blocks are ``blocks`` (ascending): the index of the first
    object of each one's block, so a failed object stops what follows from its block on."""
    return np.searchsorted(blocks, blocks, side="left").astype(np.int64)


def read_objects(
    paths: Sequence[str],
    names: Sequence[bytes],
    lengths: Sequence[int],
    pieces: Rows,
    blocks: npt.NDArray[np.int64],
    *,
    deadline: float,
    direct: objio.DirectReads | None,
) -> fileio.FileBatch:
    """A batch reading object ``k`` (``names[k]``, ``lengths[k]`` payload bytes) from
    ``paths[k]`` into its pieces, verified as :func:`~kv_file.objio.read_object` verifies:
    the header's magic, version, name and length, and the checksum. ``blocks[k]``: its
    block (a failure stops the later blocks). The objects' write stamps: the batch's
    :meth:`~kvcore.fileio.FileBatch.tails`."""
    use_direct = direct is not None and direct.enabled
    return fileio.read_batch(
        paths,
        [head_fields(name, length) for name, length in zip(names, lengths, strict=True)],
        np.fromiter((header_size(len(n)) for n in names), dtype=np.int64, count=len(names)),
        pieces.rows,
        pieces.starts,
        digest_prefixes=names,
        digest_offset=DIGEST_AT,
        compare_mask=HEAD_COMPARE_MASK,
        group_starts=group_starts(blocks),
        deadline=deadline,
        direct=use_direct,
    )


def write_objects(
    temps: Sequence[str],
    paths: Sequence[str],
    names: Sequence[bytes],
    lengths: Sequence[int],
    metas: Sequence[bytes | None],
    stamped: tuple[Sequence[bytes], Sequence[int]] | None,
    pieces: Rows,
    blocks: npt.NDArray[np.int64],
    *,
    deadline: float,
    sync: bool,
) -> fileio.FileBatch:
    """A batch writing object ``k`` as :func:`~kv_file.objio.write_object` does: header
    (with ``metas[k]`` when it fits), name and payload into ``temps[k]``, synced when asked,
    renamed over ``paths[k]``; in the header, its checksum and its block's write stamp
    (:mod:`kv_file.stamps`).

    ``stamped``: each object's checksum and stamp, computed already; None: the batch computes
    them, each block's objects written together (every object of a block must be in the
    batch: the stamp covers them all)."""
    if stamped is None:
        heads = [head_fields(n, size, m) for n, size, m in zip(names, lengths, metas, strict=True)]
    else:
        heads = []
        checksums, stamps = stamped
        for n, size, m, digest, stamp in zip(names, lengths, metas, checksums, stamps, strict=True):
            head = header_template(n, size, m, stamp)  # the whole page: its stamp at the end
            head[DIGEST_AT : DIGEST_AT + 16] = digest
            heads.append(bytes(head))
    return fileio.write_batch(
        temps,
        paths,
        heads,
        np.fromiter((header_size(len(n)) for n in names), dtype=np.int64, count=len(names)),
        pieces.rows,
        pieces.starts,
        digest_prefixes=names,
        digest_offset=DIGEST_AT if stamped is None else None,
        group_starts=group_starts(blocks),
        deadline=deadline,
        sync=sync,
        stamp_groups=stamped is None,
    )
