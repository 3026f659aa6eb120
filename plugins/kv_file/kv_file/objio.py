"""Reading and writing one object file, straight from and into the caller's buffer."""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import fcntl
import logging
import mmap
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from kv_file.objfile import (
    HEADER,
    MAX_NAME_BYTES,
    PAGE,
    Header,
    checksum,
    header_size,
    pack_header,
)

__all__ = ["DirectReads", "ReadOutcome", "read_object", "write_object", "write_then_rename"]

T = TypeVar("T")

log = logging.getLogger("kvcore.file")

_O_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
_O_TEMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


class ReadOutcome(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no file (never written, or evicted by someone)
    WRONG_SIZE = "wrong_size"  # a valid object of another size than the buffer: a plain miss
    COLLISION = "collision"  # a valid object of another name with the same hash
    CORRUPT = "corrupt"  # failed verification: the file was removed


class _CacheStat(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in ("nr_cache", "nr_dirty", "nr_writeback",
                                              "nr_evicted", "nr_recently_evicted")]  # fmt: skip


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


#: ``cachestat(2)`` (Linux 6.5): how many of a file's pages the page cache holds, with no I/O.
_NR_CACHESTAT = 451
_libc = ctypes.CDLL(None, use_errno=True)


class DirectReads:
    """Reads of objects the page cache does not hold go around it, with ``O_DIRECT``.

    Why: a buffered read of a cold 3.5 MiB file is one synchronous readahead of small folios,
    which the block layer splits into ~1 MiB requests; measured on a virtio disk that reached
    0.6x of one sequential file's cold rate, at any thread count. Direct reads of the same
    files from a few threads reach 1.0x. Warm objects still come from the page cache.

    Whether a file is cached is asked with ``cachestat(2)``, which does no I/O; probing with
    ``preadv2(RWF_NOWAIT)`` instead would start the very readahead this avoids. Direct I/O needs
    page-aligned buffers of page-multiple length; other buffers, kernels without
    ``cachestat`` and file systems that refuse ``O_DIRECT`` (found on first use) read buffered.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and hasattr(os, "O_DIRECT") and sys.platform == "linux"
        self.count = 0  # reads that went around the page cache
        self._lock = threading.Lock()
        self._local = threading.local()

    def usable(self, hsize: int, view: memoryview) -> bool:
        return (
            self.enabled
            and len(view) % PAGE == 0
            and hsize % PAGE == 0
            and _address(view) % PAGE == 0
        )

    def head_buffer(self, hsize: int) -> memoryview:
        """A page-aligned buffer of ``hsize`` bytes, one per thread (reused)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < hsize:
            buf = mmap.mmap(-1, max(hsize, PAGE))
            self._local.buf = buf
        return memoryview(buf)[:hsize]

    def path_cached(self, path: str) -> bool:
        """:meth:`cached` for a file by path (False when it is missing)."""
        try:
            fd = os.open(path, _O_READ)
        except OSError:
            return False
        try:
            return self.cached(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def cached(self, fd: int, size: int) -> bool:
        """Whether the page cache holds every page of the file (True when it cannot tell)."""
        local = self._local
        if not hasattr(local, "stat"):
            local.stat, local.range = _CacheStat(), _CacheStatRange(0, 0)
        if _libc.syscall(_NR_CACHESTAT, fd, ctypes.byref(local.range), ctypes.byref(local.stat), 0):
            self.disable(OSError(ctypes.get_errno(), "cachestat"))
            return True
        return local.stat.nr_cache * PAGE >= size

    def counted(self) -> None:
        with self._lock:
            self.count += 1

    def disable(self, why: OSError) -> None:
        if self.enabled:
            self.enabled = False
            log.info("kv_file: direct reads off (%s); reading through the page cache", why)


def read_object(
    path: str, name: bytes, view: memoryview, *, direct: DirectReads | None = None
) -> ReadOutcome:
    """Fill ``view`` with the object stored at ``path`` under ``name``, verified.

    One vectored read puts the header in a small buffer and the payload directly in ``view``
    (from the page cache, or with ``O_DIRECT`` when ``direct`` allows and the page cache does
    not hold it); the checksum is then computed over ``view`` itself.
    """
    try:
        fd = os.open(path, _O_READ)
    except FileNotFoundError:
        return ReadOutcome.MISSING
    try:
        st = os.fstat(fd)
        hsize = header_size(len(name))
        total = hsize + len(view)
        if st.st_size != total:
            return _classify(fd, path, st, name, len(view))
        if direct is not None and direct.usable(hsize, view):
            head = direct.head_buffer(hsize)
            if not direct.cached(fd, total):
                got = _read_direct(fd, head, view, direct)
                return _verify(fd, path, st, name, head, view, got == total)
        else:
            head = memoryview(bytearray(hsize))
        got = os.preadv(fd, [head, view], 0)
        return _verify(fd, path, st, name, head, view, got == total)
    finally:
        os.close(fd)


def _verify(
    fd: int,
    path: str,
    st: os.stat_result,
    name: bytes,
    head: memoryview,
    view: memoryview,
    complete: bool,
) -> ReadOutcome:
    header = Header.parse(head)
    if (
        not complete
        or header is None
        or header.name_len != len(name)
        or header.length != len(view)
        or head[HEADER.size : HEADER.size + len(name)] != name
    ):
        return _classify(fd, path, st, name, len(view))
    if checksum(name, view) != header.digest:
        return _remove_corrupt(fd, path, st)
    return ReadOutcome.OK


def _read_direct(fd: int, head: memoryview, view: memoryview, direct: DirectReads) -> int:
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as exc:  # O_DIRECT refused (some FUSE and network file systems)
        direct.disable(exc)
        return os.preadv(fd, [head, view], 0)
    try:
        got = os.preadv(fd, [head, view], 0)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        direct.disable(exc)  # accepted at open, refused on read (alignment rules of the fs)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        return os.preadv(fd, [head, view], 0)
    direct.counted()
    return got


def _address(view: memoryview) -> int:
    """The start address of a writable buffer (no copy)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def write_object(path: str, temp: str, name: bytes, view: memoryview, *, sync: bool) -> int:
    """Write ``view`` under ``name`` to a temp file, sync it if asked, rename it to ``path``.

    Readers see the old file or the new one, never a partial one. Returns the file's size.
    Raises OSError (the temp file is removed first).
    """
    if len(name) > MAX_NAME_BYTES:
        raise OSError(f"object name of {len(name)} bytes exceeds {MAX_NAME_BYTES}")

    def fill(fd: int) -> int:
        header = pack_header(name, view)
        total = len(header) + len(view)
        done = os.writev(fd, [header, view])
        while done < total:  # short writes: rare, but legal
            if done < len(header):
                done += os.write(fd, header[done:])
            else:
                done += os.write(fd, view[done - len(header) :])
        if sync:
            os.fdatasync(fd)
        return total

    return write_then_rename(temp, path, fill)


def write_then_rename(temp: str, path: str, fill: Callable[[int], T]) -> T:
    """Create ``temp`` (0600, exclusively), ``fill`` it, rename it over ``path``.

    Readers see the old file or the new one, never a partial one. On any failure the temp
    file is removed and the error raised. Returns what ``fill`` returned.
    """
    fd = os.open(temp, _O_TEMP, 0o600)
    try:
        try:
            out = fill(fd)
        finally:
            os.close(fd)
        os.rename(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return out


def _classify(fd: int, path: str, st: os.stat_result, name: bytes, want: int) -> ReadOutcome:
    """Why a file is not the object this read expects: another object, or a torn one."""
    header = Header.parse(os.pread(fd, HEADER.size, 0))
    if header is None or st.st_size != header.size + header.length:
        return _remove_corrupt(fd, path, st)  # bad magic, truncated, or a wrong length field
    stored = os.pread(fd, header.name_len, HEADER.size)
    if stored == name and header.length != want:
        return ReadOutcome.WRONG_SIZE  # a valid object, just not of the buffer's size
    payload = os.pread(fd, header.length, header.size)
    if stored != name and checksum(stored, payload) == header.digest:
        return ReadOutcome.COLLISION  # a valid object of another name with the same hash
    return _remove_corrupt(fd, path, st)


def _remove_corrupt(fd: int, path: str, st: os.stat_result) -> ReadOutcome:
    """Unlink ``path`` if it is still the file we verified (not a fresh one renamed over it)."""
    with contextlib.suppress(OSError):
        now = os.stat(path, follow_symlinks=False)
        if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
            os.unlink(path)
    return ReadOutcome.CORRUPT
