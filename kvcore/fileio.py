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

.. versionadded:: 0.3
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence

from kvcore import _fileio

__all__ = [
    "NATIVE_DIGESTS",
    "NATIVE_IO_ENV",
    "FileRead",
    "describe",
    "enabled",
    "read_file",
    "write_file",
]

#: Whether the native reads compute the xxh3-128 digest (False when kvcore was built without
#: xxhash's header: the caller then hashes the pieces itself).
NATIVE_DIGESTS: bool = bool(_fileio.HAVE_DIGEST)


#: ``KVCORE_NATIVE_IO=0``: backends that use this module read and write with their own Python
#: code instead (for comparison, or to rule out the native path in a fault).
NATIVE_IO_ENV = "KVCORE_NATIVE_IO"


def enabled() -> bool:
    """Whether backends should read and write through this module (the default), as the
    operator chose with :data:`NATIVE_IO_ENV`."""
    return os.environ.get(NATIVE_IO_ENV, "1").strip() != "0"


def describe() -> str:
    """Which file I/O path backends take, in one line for operators (``kvcore backends``)."""
    if not enabled():
        return f"file I/O: Python ({NATIVE_IO_ENV}=0)"
    if NATIVE_DIGESTS:
        return "file I/O: native (kvcore.fileio; xxh3 checksums in C++)"
    return "file I/O: native, checksums in Python (kvcore was built without xxhash.h)"


class FileRead(enum.IntEnum):
    """What :func:`read_file` found."""

    OK = _fileio.OK  #: head and pieces filled; the digest computed when asked
    MISSING = _fileio.MISSING  #: no file at the path
    #: something else is there (not a regular file, another size, a symlink, a file that
    #: shrank while read): the caller's own code looks at it
    OTHER = _fileio.OTHER
    ERRNO = _fileio.ERRNO  #: a system call failed with the returned errno
    #: ``O_DIRECT`` or ``cachestat(2)`` refused (the returned errno): nothing was decided about
    #: the file; read it again without ``direct``
    DIRECT_REFUSED = _fileio.DIRECT_REFUSED


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

    ``direct``: when the page cache does not hold the whole file and the head's length and
    every piece's address and length are multiples of 4 KiB, read around the page cache.
    ``digest_prefix``: also compute the canonical xxh3-128 of the prefix, the payload's
    length (u64, little-endian) and the payload (when :data:`NATIVE_DIGESTS`).

    Returns ``(code, errno, read_directly, digest)``: ``code`` a :class:`FileRead` value (an
    int: compare with the members), ``errno`` set for ``ERRNO`` and ``DIRECT_REFUSED``, the
    digest or None. Raises TypeError for a read-only or non-contiguous buffer.
    """
    return _fileio.read_file(os.fspath(path), head, pieces, direct, digest_prefix)


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
    return _fileio.write_file(os.fspath(temp), os.fspath(path), head, offset, prefix, pieces, sync)
