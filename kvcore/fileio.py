"""Whole-file reads and writes straight from and into the caller's memory, in native code
(``csrc/file_ops.cc``).

A backend that keeps one object per file reads it here in one call that holds no GIL: the
open, the ``fstat``, the choice between the page cache and ``O_DIRECT`` (``cachestat(2)``), one
vectored read of the file's head into a small buffer and of its payload into the caller's
pieces (an engine's cache block, one piece per layer), and the payload's xxh3-128. What the
head must say is the backend's file format, checked by the backend: nothing here knows it.
A write is the same in reverse: the digest put into the caller's head, one vectored write of
head and payload into a new temp file, an optional ``fdatasync``, the rename over the name.

The Python work per object shrinks to one call and a comparison, and the I/O threads of a
backend no longer contend for the interpreter with the engine's own thread while they read.

A batch (:func:`read_batch`, :func:`write_batch`) takes the Python call per object away too:
the objects' paths, expected heads and pieces are handed over once, and any number of threads
run the batch (:meth:`FileBatch.run`), each taking the next object from a shared counter with
no lock and no GIL, until none is left; reads are verified there (the head against what the
caller expects, the digest against the head's). What stays in Python is what the batch
returns: one code per object (:class:`FileRead`).

In an install built without a C++ compiler (:mod:`kvcore.native`) this module has no native
code: :func:`enabled` is False, so backends take their own Python path, and the I/O functions
raise :class:`NativeIOMissing`.

.. versionadded:: 0.3
.. versionchanged:: 0.3 batches: :func:`read_batch`, :func:`write_batch`, :class:`FileBatch`;
   the extension may be absent (:data:`AVAILABLE`).
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcore.native import file_ops

__all__ = [
    "AVAILABLE",
    "DIGEST_KERNEL",
    "NATIVE_DIGESTS",
    "NATIVE_IO_ENV",
    "FileBatch",
    "FileRead",
    "NativeIOMissing",
    "describe",
    "digest_batch",
    "enabled",
    "read_batch",
    "read_file",
    "write_batch",
    "write_file",
]

#: Whether this install has the native file I/O (``kvcore._fileio``; False where kvcore was
#: built without a C++ compiler).
#:
#: .. versionadded:: 0.3
AVAILABLE: bool = file_ops is not None
#: Whether the native reads compute the xxh3-128 digest (False when kvcore was built without
#: xxhash's header, or without the extension: the caller then hashes the pieces itself).
NATIVE_DIGESTS: bool = bool(file_ops is not None and file_ops.HAVE_DIGEST)
#: Which xxh3 kernel computes the digests: ``"avx512"`` or ``"avx2"`` where the CPU has it,
#: else ``"baseline"`` (what the build targets: SSE2 on x86-64); ``"none"`` without digests.
#: Every kernel gives the same digest.
#:
#: .. versionadded:: 0.3
DIGEST_KERNEL: str = "none" if file_ops is None else file_ops.DIGEST_KERNEL


#: ``KVCORE_NATIVE_IO=0``: backends that use this module read and write with their own Python
#: code instead (for comparison, or to rule out the native path in a fault).
NATIVE_IO_ENV = "KVCORE_NATIVE_IO"


class NativeIOMissing(RuntimeError):
    """This install has no native file I/O (built without a C++ compiler): check
    :func:`enabled` before calling the I/O functions.

    .. versionadded:: 0.3
    """


def _native() -> Any:
    """The extension, or :class:`NativeIOMissing`."""
    if file_ops is None:
        raise NativeIOMissing(
            "kvcore was built without its native file I/O (no C++ compiler): "
            "kvcore.fileio.enabled() is False, use the Python path"
        )
    return file_ops


def enabled() -> bool:
    """Whether backends should read and write through this module: the default where the
    extension is there (:data:`AVAILABLE`), unless the operator chose otherwise with
    :data:`NATIVE_IO_ENV`."""
    return AVAILABLE and os.environ.get(NATIVE_IO_ENV, "1").strip() != "0"


def describe() -> str:
    """Which file I/O path backends take, in one line for operators (``kvcore backends``)."""
    if not AVAILABLE:
        return "file I/O: Python (kvcore was built without its native extension)"
    if not enabled():
        return f"file I/O: Python ({NATIVE_IO_ENV}=0)"
    if NATIVE_DIGESTS:
        return (
            "file I/O: native, in batches (kvcore.fileio; xxh3 checksums in C++, "
            f"{DIGEST_KERNEL} kernel)"
        )
    return "file I/O: native, checksums in Python (kvcore was built without xxhash.h)"


_BATCH_READ, _BATCH_WRITE, _BATCH_DIGEST = 0, 1, 2  # the extension's batch kinds (file_ops.h)


class FileRead(enum.IntEnum):
    """What :func:`read_file` found. The values are the extension's (``csrc/file_ops.h``),
    spelled out so the enum exists without it."""

    OK = 0  #: head and pieces filled; the digest computed when asked
    MISSING = 1  #: no file at the path
    #: something else is there (not a regular file, another size, a symlink, a file that
    #: shrank while read): the caller's own code looks at it
    OTHER = 2
    ERRNO = 3  #: a system call failed with the returned errno
    #: ``O_DIRECT`` or ``cachestat(2)`` refused (the returned errno): nothing was decided about
    #: the file; read it again without ``direct``
    DIRECT_REFUSED = 4
    #: (batches) not started: the batch's deadline had passed
    DEADLINE = 5
    #: (batches) not started: an object of its group, or of an earlier one, failed
    SKIPPED = 6
    #: (read batches) the file is there and whole, but its head is not what was expected or
    #: its digest does not match: the caller's own code looks at it
    MISMATCH = 7


def read_file(
    path: str | os.PathLike[str],
    head: bytearray | memoryview,
    pieces: Sequence[memoryview],
    *,
    direct: bool = False,
    digest_prefix: bytes | None = None,
) -> tuple[int, int, bool, bytes | None]:
    """Read the regular file at ``path`` whole: its first ``len(head)`` bytes into ``head``,
    the rest into ``pieces`` in order. It must be exactly that long (else ``OTHER``).

    ``direct``: when the page cache lacks the file's first or last page (a file leaves the
    cache oldest pages first, so one that lost pages lost those) and the head's length and
    every piece's address and length are multiples of 4 KiB, read around the page cache.
    ``digest_prefix``: also compute the canonical xxh3-128 of the prefix, the payload's
    length (u64, little-endian) and the payload (when :data:`NATIVE_DIGESTS`).

    Returns ``(code, errno, read_directly, digest)``: ``code`` a :class:`FileRead` value (an
    int: compare with the members), ``errno`` set for ``ERRNO`` and ``DIRECT_REFUSED``, the
    digest or None. Raises TypeError for a read-only or non-contiguous buffer.
    """
    return _native().read_file(os.fspath(path), head, pieces, direct, digest_prefix)


def write_file(
    temp: str | os.PathLike[str],
    path: str | os.PathLike[str],
    head: bytearray | memoryview,
    pieces: Sequence[memoryview | bytes],
    *,
    sync: bool = False,
    digest_offset: int | None = None,
    digest_prefix: bytes = b"",
) -> int:
    """Write ``head`` then ``pieces`` to ``temp`` (created 0600, exclusively), ``fdatasync``
    it when ``sync``, rename it over ``path``: readers see the old file or the new one.

    ``digest_offset``: first put the digest of ``digest_prefix`` and the pieces (as
    :func:`read_file` computes it) into ``head[digest_offset:digest_offset + 16]``; needs
    :data:`NATIVE_DIGESTS`. Returns 0, or the errno of the call that failed (``temp`` is then
    removed).
    """
    offset = -1 if digest_offset is None else digest_offset
    prefix = None if digest_offset is None else digest_prefix
    return _native().write_file(
        os.fspath(temp), os.fspath(path), head, offset, prefix, pieces, sync
    )


class FileBatch:
    """Many objects' reads or writes, made by :func:`read_batch` or :func:`write_batch`.

    Call :meth:`run` from every thread that should work on it (the caller's own included),
    then :meth:`results` once they all returned. Objects come in groups (a block's parts;
    ``group_starts[k]``: the index of the first object of object ``k``'s group, each object
    its own group when not given): after an object fails (missing, an error), no object from
    its group's first on starts any more (``SKIPPED``), and past the deadline none does
    (``DEADLINE``). Whatever memory
    the objects' pieces point at must stay valid until every :meth:`run` returned.
    """

    __slots__ = ("_batch", "size")

    def __init__(self, batch: Any, size: int) -> None:
        self._batch = batch
        self.size = size  #: objects in the batch

    def run(self) -> None:
        """Take objects until none is left (the GIL released)."""
        self._batch.run()

    def results(self) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], int, int]:
        """``(codes, errnos, direct_reads, refused_errno)``: each object's :class:`FileRead`
        code and errno (int32 arrays), how many reads went around the page cache, and the
        errno with which ``O_DIRECT`` was refused (0: never; the batch then read buffered)."""
        codes, errnos, direct_reads, refused = self._batch.results()
        return (
            np.frombuffer(codes, dtype=np.int32),
            np.frombuffer(errnos, dtype=np.int32),
            direct_reads,
            refused,
        )

    def digests(self) -> list[bytes]:
        """Digest batches (:func:`digest_batch`): each object's 16-byte digest. Once every
        :meth:`run` returned.

        .. versionadded:: 0.3
        """
        raw = self._batch.digests()
        return [raw[at : at + 16] for at in range(0, len(raw), 16)]

    def tails(self) -> npt.NDArray[np.uint64]:
        """Reads: each object's last 8 head bytes as a little-endian uint64 (0 for an object
        not read whole and verified), where a caller keeps a small stamp of its own (kv_file:
        the write that made the object). Once every :meth:`run` returned.

        .. versionadded:: 0.3
        """
        return np.frombuffer(self._batch.tails(), dtype="<u8")


def _batch(
    kind: int,
    paths: Sequence[str],
    temps: Sequence[str] | None,
    heads: Sequence[bytes],
    head_lens: npt.ArrayLike,
    pieces: npt.ArrayLike,
    piece_starts: npt.ArrayLike,
    digest_prefixes: Sequence[bytes],
    digest_offset: int | None,
    group_starts: npt.ArrayLike | None,
    deadline: float | None,
    *,
    compare_mask: bytes | None = None,
    direct: bool = False,
    sync: bool = False,
    stamp_groups: bool = False,
) -> FileBatch:
    """The native batch of :func:`read_batch` or :func:`write_batch`: the heads joined, every
    array as contiguous int64."""
    offsets = np.zeros(len(heads) + 1, dtype=np.int64)
    np.cumsum([len(h) for h in heads], out=offsets[1:])

    def int64s(values: npt.ArrayLike) -> npt.NDArray[np.int64]:
        return np.ascontiguousarray(values, dtype=np.int64)

    batch = _native().batch(
        kind, paths, temps, b"".join(heads), offsets, int64s(head_lens), digest_prefixes,
        int64s(pieces), int64s(piece_starts),
        None if group_starts is None else int64s(group_starts),
        math.inf if deadline is None else deadline,
        -1 if digest_offset is None else digest_offset, compare_mask, direct, sync,
        stamp_groups,
    )  # fmt: skip
    return FileBatch(batch, len(paths))


def read_batch(
    paths: Sequence[str],
    expected_heads: Sequence[bytes],
    head_lens: npt.NDArray[np.int64],
    pieces: npt.NDArray[np.int64],
    piece_starts: npt.NDArray[np.int64],
    *,
    digest_prefixes: Sequence[bytes],
    digest_offset: int | None,
    compare_mask: bytes | None = None,
    group_starts: npt.NDArray[np.int64] | None = None,
    deadline: float | None = None,
    direct: bool = False,
) -> FileBatch:
    """A batch of whole-file reads: object ``k`` is the file at ``paths[k]``, its first
    ``head_lens[k]`` bytes a head, the rest read into its pieces: rows
    ``piece_starts[k] .. piece_starts[k + 1]`` of ``pieces`` (``(address, nbytes)`` int64
    rows, as :meth:`kvcore.HostBuffers.iovecs` gives them).

    Verified as it arrives: the head's first ``len(expected_heads[k])`` bytes must equal
    ``expected_heads[k]`` (except byte ``i`` where ``compare_mask[i] == 0``), and with
    ``digest_offset`` the payload's digest (as :func:`read_file` computes it with
    ``digest_prefixes[k]``, when :data:`NATIVE_DIGESTS`) must equal the 16 bytes at that
    offset of the head; else ``MISMATCH``. ``deadline``: a :func:`time.monotonic` instant.
    """
    return _batch(
        _BATCH_READ, paths, None, expected_heads, head_lens, pieces, piece_starts,
        digest_prefixes, digest_offset, group_starts, deadline, compare_mask=compare_mask,
        direct=direct,
    )  # fmt: skip


def write_batch(
    temps: Sequence[str],
    paths: Sequence[str],
    heads: Sequence[bytes],
    head_lens: npt.NDArray[np.int64],
    pieces: npt.NDArray[np.int64],
    piece_starts: npt.NDArray[np.int64],
    *,
    digest_prefixes: Sequence[bytes],
    digest_offset: int | None,
    group_starts: npt.NDArray[np.int64] | None = None,
    deadline: float | None = None,
    sync: bool = False,
    stamp_groups: bool = False,
) -> FileBatch:
    """A batch of whole-file writes, each as :func:`write_file`: ``heads[k]`` then zeros up
    to ``head_lens[k]`` bytes, then the object's pieces (rows ``piece_starts[k] ..
    piece_starts[k + 1]`` of ``pieces``), into ``temps[k]``, renamed over ``paths[k]``;
    ``digest_offset``: the digest put into the head first (needs :data:`NATIVE_DIGESTS`).
    An object's code is ``OK`` or ``ERRNO`` (its temp file then removed), or it was not
    started.

    ``stamp_groups`` (with ``digest_offset`` and ``group_starts``): a group's objects are
    written together, and the last 8 bytes of each head are the group's write stamp: XXH3-64
    of the group's digests in order, little-endian. Each payload is written and hashed in one
    pass; the object that completes a group writes its heads and renames its files. In a
    group where one object failed or was not started, the others are abandoned (``ERRNO``,
    ``ECANCELED``): none of them is renamed.

    .. versionchanged:: 0.3 ``stamp_groups``
    """
    if digest_offset is not None and not NATIVE_DIGESTS:
        raise ValueError("digests in a write batch need kvcore built with xxhash.h")
    if stamp_groups and (digest_offset is None or group_starts is None):
        raise ValueError("stamp_groups needs digest_offset and group_starts")
    return _batch(
        _BATCH_WRITE, paths, temps, heads, head_lens, pieces, piece_starts,
        digest_prefixes, digest_offset, group_starts, deadline, sync=sync,
        stamp_groups=stamp_groups,
    )  # fmt: skip


def digest_batch(
    pieces: npt.NDArray[np.int64],
    piece_starts: npt.NDArray[np.int64],
    *,
    digest_prefixes: Sequence[bytes],
) -> FileBatch:
    """A batch computing, for object ``k`` (its pieces: rows ``piece_starts[k] ..
    piece_starts[k + 1]`` of ``pieces``), the digest :func:`read_file` computes with
    ``digest_prefixes[k]``, from memory, on every thread that calls :meth:`FileBatch.run`;
    :meth:`FileBatch.digests` has them. Needs :data:`NATIVE_DIGESTS`.

    .. versionadded:: 0.3
    """
    if not NATIVE_DIGESTS:
        raise ValueError("a digest batch needs kvcore built with xxhash.h")
    n = len(digest_prefixes)
    return _batch(
        _BATCH_DIGEST, [""] * n, None, [b""] * n, np.zeros(n, dtype=np.int64), pieces,
        piece_starts, digest_prefixes, None, None, None,
    )  # fmt: skip
