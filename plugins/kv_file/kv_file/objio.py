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
import stat
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from kv_file.objfile import (
    DIGEST_AT,
    HEADER,
    MAX_NAME_BYTES,
    PAGE,
    Header,
    checksum,
    header_size,
    header_template,
    pack_header,
    stamp_of,
)
from kv_file.paths import discard, name_digest
from kvcore import fileio

__all__ = [
    "DirectReads",
    "ReadOutcome",
    "read_meta",
    "read_name",
    "read_object",
    "stamp_in_file",
    "write_object",
    "write_then_rename",
]

T = TypeVar("T")

log = logging.getLogger("kvcore.file")

# O_NONBLOCK: opening a FIFO left where an object belongs must not wait for a writer
_O_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: iovecs one preadv/writev takes at most (Linux's IOV_MAX; a segmented object has one per
#: layer, plus the header)
_IOV_MAX = 1024
_O_TEMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


#: ``KVCORE_NATIVE_IO=0`` (:data:`kvcore.fileio.NATIVE_IO_ENV`) reads and writes objects with
#: this module's Python code instead of kvcore's native file I/O; the two give the same
#: outcomes and files, byte for byte.
NATIVE_IO_ENV = fileio.NATIVE_IO_ENV
#: whether :func:`read_object` and :func:`write_object` go through :mod:`kvcore.fileio`
#: (tests switch it)
native_io = fileio.enabled()
_heads = threading.local()  # per thread: the buffer native reads put an object's header in


class ReadOutcome(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no file (never written, or evicted by someone)
    WRONG_SIZE = "wrong_size"  # a valid object of the expected size, but the buffer differs
    MISNAMED = "misnamed"  # a valid object stored where its own name belongs: the lookup
    # used a wrong digest for this name (a lying name snapshot, or a real hash collision)
    FOREIGN = "foreign"  # not this name's object (another size, misplaced, not a regular
    # file): removed, so a rewrite lands
    CORRUPT = "corrupt"  # failed verification: the file was removed


class _CacheStat(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in ("nr_cache", "nr_dirty", "nr_writeback",
                                              "nr_evicted", "nr_recently_evicted")]  # fmt: skip


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


#: ``cachestat(2)`` (Linux 6.5): how many of a file's pages the page cache holds, with no I/O.
_NR_CACHESTAT = 451
#: a file of up to this many pages is asked about whole (one call), a larger one by its first
#: and last pages (``page_cache_holds`` in ``csrc/file_ops.cc``)
_WHOLE_PROBE_PAGES = 24
_libc = ctypes.CDLL(None, use_errno=True)
#: ``statfs(2)``'s ``f_type`` of file systems whose files live in the page cache only
_MEMORY_FILE_SYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def memory_file_system(path: str) -> str | None:
    """The name of the memory-backed file system ``path`` is on (tmpfs, ramfs), else None
    (also when it cannot tell)."""
    if sys.platform != "linux":
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes, f_type first (a long)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return _MEMORY_FILE_SYSTEMS.get(ctypes.c_ulong.from_buffer(buf).value)


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
    A store on a memory-backed file system (tmpfs) reads buffered from the start: its files
    are the page cache, so there is nothing to go around, and asking ``cachestat`` about each
    object would be pure cost (0.6 µs of 7 per 64 KiB object, measured).
    """

    def __init__(self, enabled: bool, root: str | None = None) -> None:
        self.enabled = enabled and hasattr(os, "O_DIRECT") and sys.platform == "linux"
        in_memory = None if root is None or not self.enabled else memory_file_system(root)
        if in_memory is not None:
            self.enabled = False
            log.info("kv_file: %s is on %s: direct reads off (its files are memory)", root,
                     in_memory)  # fmt: skip
        self.count = 0  # reads that went around the page cache
        self._lock = threading.Lock()
        self._local = threading.local()

    def usable(self, hsize: int, pieces: list[memoryview]) -> bool:
        return (
            self.enabled
            and hsize % PAGE == 0
            and all(len(p) % PAGE == 0 and _address(p) % PAGE == 0 for p in pieces)
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
        """Whether the page cache holds the file, as its first and last pages tell (True when
        it cannot tell). Why two pages, not all: see ``page_cache_holds`` in
        ``csrc/file_ops.cc``, which decides the same for the native path."""
        local = self._local
        if not hasattr(local, "stat"):
            local.stat, local.range = _CacheStat(), _CacheStatRange(0, 0)
        whole = size <= _WHOLE_PROBE_PAGES * PAGE
        probes = [(0, 0)] if whole else [(0, PAGE), ((size - 1) // PAGE * PAGE, PAGE)]
        for local.range.off, local.range.len in probes:
            if _libc.syscall(
                _NR_CACHESTAT, fd, ctypes.byref(local.range), ctypes.byref(local.stat), 0
            ):
                self.disable(OSError(ctypes.get_errno(), "cachestat"))
                return True
            if local.stat.nr_cache * PAGE < (size if whole else 1):
                return False
        return True

    def counted(self, reads: int = 1) -> None:
        if reads:
            with self._lock:
                self.count += reads

    def disable(self, why: OSError) -> None:
        if self.enabled:
            self.enabled = False
            log.info("kv_file: direct reads off (%s); reading through the page cache", why)


def read_object(
    path: str,
    name: bytes,
    pieces: list[memoryview],
    *,
    digest: int,
    expected_len: int | None = None,
    direct: DirectReads | None = None,
    native: bool = True,
    stamp: list[int] | None = None,
) -> ReadOutcome:
    """Fill ``pieces`` with the object stored at ``path`` (the file of ``digest``) under
    ``name``, verified: the payload's bytes in order, split over the pieces (one staging
    region, or an engine's own cache block, one piece per layer).

    One vectored read puts the header in a small buffer and the payload directly in the
    pieces (from the page cache, or with ``O_DIRECT`` when ``direct`` allows and the page cache
    does not hold it); the checksum is then computed over the pieces themselves. ``expected_len``: the
    payload size an object of this name must have (None: unknown); a stored object of another
    size is foreign and removed.

    With :data:`native_io`, all of this but the rare cases runs in one native call that
    holds no GIL (:func:`_read_native`); whatever that call does not settle is read again here.
    ``native=False``: straight to this code (a native batch already read the file and could
    not settle it). ``stamp``: where the object's write stamp goes when it is read
    (:func:`kv_file.objfile.stamp_of`; appended).
    """
    if native and native_io:
        outcome = _read_native(path, name, pieces, direct, stamp)
        if outcome is not None:
            return outcome
    try:
        fd = os.open(path, _O_READ)
    except FileNotFoundError:
        return ReadOutcome.MISSING
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        return ReadOutcome.FOREIGN if discard(path) else ReadOutcome.MISSING  # a symlink
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a directory or a FIFO
            return ReadOutcome.FOREIGN if discard(path, st) else ReadOutcome.MISSING
        want = sum(len(p) for p in pieces)
        check = _Check(fd, path, st, name, want, digest, expected_len, stamp)
        hsize = header_size(len(name))
        total = hsize + want
        if st.st_size != total:
            return check.classify()
        # cachestat first: a page-cache hit (the common case) never pays for the alignment
        # check of every piece
        if (
            direct is not None
            and direct.enabled
            and not direct.cached(fd, total)
            and direct.usable(hsize, pieces)
        ):
            head = direct.head_buffer(hsize)
            got = _read_direct(fd, [head, *pieces], direct)
            return check.verify(head, pieces, got == total)
        head = memoryview(bytearray(hsize))
        got = _preadv_all(fd, [head, *pieces])
        return check.verify(head, pieces, got == total)
    finally:
        os.close(fd)


def _read_native(
    path: str,
    name: bytes,
    pieces: list[memoryview],
    direct: DirectReads | None,
    stamp: list[int] | None,
) -> ReadOutcome | None:
    """:func:`read_object` in one native call: OK or MISSING, or None for anything to look at
    again in Python (a file of another size or kind, a header or checksum that does not
    verify, direct reads refused). Raises the OSError of a failed read (e.g. EFAULT)."""
    hsize = header_size(len(name))
    head = getattr(_heads, "buf", None)
    if head is None or len(head) != hsize:
        head = _heads.buf = bytearray(hsize)
    use_direct = direct is not None and direct.enabled
    code, err, read_directly, got = fileio.read_file(
        path, head, pieces, direct=use_direct, digest_prefix=name
    )
    if code == fileio.FileRead.OK:
        if read_directly and direct is not None:
            direct.counted()
        header = Header.parse(head)
        if (
            header is None
            or header.name_len != len(name)
            or header.length != sum(len(p) for p in pieces)
            or head[HEADER.size : HEADER.size + len(name)] != name
        ):
            return None
        if got is None:  # kvcore built without xxhash's header: hash here
            got = checksum(name, pieces)
        if got != header.digest:
            return None
        if stamp is not None:
            stamp.append(stamp_of(head))
        return ReadOutcome.OK
    if code == fileio.FileRead.MISSING:
        return ReadOutcome.MISSING
    if code == fileio.FileRead.ERRNO:
        raise OSError(err, os.strerror(err), path)
    if code == fileio.FileRead.DIRECT_REFUSED and direct is not None:
        direct.disable(OSError(err, os.strerror(err)))
    return None


class _Check:
    """Verification of one opened object file, and what to do with it when it fails."""

    def __init__(
        self,
        fd: int,
        path: str,
        st: os.stat_result,
        name: bytes,
        want: int,
        digest: int,
        expected_len: int | None,
        stamp: list[int] | None,
    ) -> None:
        self.fd, self.path, self.st, self.name = fd, path, st, name
        self.want, self.digest, self.expected_len = want, digest, expected_len
        self.stamp = stamp

    def verify(self, head: memoryview, pieces: list[memoryview], complete: bool) -> ReadOutcome:
        header = Header.parse(head)
        name = self.name
        if (
            not complete
            or header is None
            or header.name_len != len(name)
            or header.length != self.want
            or head[HEADER.size : HEADER.size + len(name)] != name
        ):
            return self.classify()
        if checksum(name, pieces) != header.digest:
            return self.remove(ReadOutcome.CORRUPT)
        if self.stamp is not None:
            self.stamp.append(stamp_of(head))
        return ReadOutcome.OK

    def classify(self) -> ReadOutcome:
        """Why the file is not the object this read expects: another object, or a torn one."""
        fd = self.fd
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if flags & _O_DIRECT:  # rechecks read small unaligned buffers: through the cache
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        header = Header.parse(os.pread(fd, HEADER.size, 0))
        if header is None or self.st.st_size != header.size + header.length:
            return self.remove(ReadOutcome.CORRUPT)  # bad magic, truncated, or a wrong length
        stored = os.pread(fd, header.name_len, HEADER.size)
        if stored == self.name and header.length != self.want:
            if self.expected_len is None or header.length == self.expected_len:
                return ReadOutcome.WRONG_SIZE  # the buffer is not of the object's size
            return self.remove(ReadOutcome.FOREIGN)  # the object is not of its name's size
        payload = os.pread(fd, header.length, header.size)
        if stored != self.name and checksum(stored, [payload]) == header.digest:
            if name_digest(stored) == self.digest:
                return ReadOutcome.MISNAMED  # its rightful place: the lookup was wrong
            return self.remove(ReadOutcome.FOREIGN)  # a valid object, in another's place
        return self.remove(ReadOutcome.CORRUPT)

    def remove(self, outcome: ReadOutcome) -> ReadOutcome:
        """Unlink the file if it is still the one verified (not a fresh one renamed over it)."""
        discard(self.path, self.st)
        return outcome


def _read_direct(fd: int, buffers: list[memoryview], direct: DirectReads) -> int:
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as exc:  # O_DIRECT refused (some FUSE and network file systems)
        direct.disable(exc)
        return _preadv_all(fd, buffers)
    try:
        got = _preadv_all(fd, buffers)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        direct.disable(exc)  # accepted at open, refused on read (alignment rules of the fs)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        return _preadv_all(fd, buffers)
    direct.counted()
    return got


def _preadv_all(fd: int, buffers: list[memoryview]) -> int:
    """Read the file from its start into ``buffers`` in order, ``IOV_MAX`` at a time, through
    short reads; the bytes read (fewer only at the end of the file).

    A read short of the file's end is continued, not taken for a short file: the kernel copies
    up to a buffer it cannot write (an engine's bad pointer) and returns the count, and the next
    read raises that error (EFAULT), which is the caller's failure, never the object's
    corruption (a good object would be removed).
    """
    done = 0
    pending = [b for b in buffers if len(b)]
    while pending:
        got = os.preadv(fd, pending[:_IOV_MAX], done)
        if got == 0:
            break  # the end of the file
        done += got
        pending = _past(pending, got)
    return done


def _writev_all(fd: int, buffers: list[memoryview]) -> None:
    """Write ``buffers`` in order, ``IOV_MAX`` at a time, through short writes (rare, legal)."""
    pending = list(buffers)
    while pending:
        pending = _past(pending, os.writev(fd, pending[:_IOV_MAX]))


def _past(pending: list[memoryview], n: int) -> list[memoryview]:
    """What is left of ``pending`` once a vectored call moved its first ``n`` bytes."""
    k = 0
    while k < len(pending) and n >= len(pending[k]):
        n -= len(pending[k])
        k += 1
    rest = pending[k:]
    if n:
        rest[0] = rest[0][n:]
    return rest


def _address(view: memoryview) -> int:
    """The start address of a writable buffer (no copy)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def write_object(
    path: str,
    temp: str,
    name: bytes,
    pieces: list[memoryview],
    *,
    sync: bool,
    meta: bytes | None = None,
    stamp: int = 0,
    checksum: bytes | None = None,
) -> int:
    """Write the payload ``pieces`` (in order) under ``name`` to a temp file, sync it if
    asked, rename it to ``path``. ``meta``: the block's metadata, kept in the header when it
    fits (:func:`kv_file.objfile.meta_fits`); ``stamp``: the block's write stamp (see
    :mod:`kv_file.stamps`); ``checksum``: the payload's, when computed already.

    Readers see the old file or the new one, never a partial one. Returns the file's size.
    Raises OSError (the temp file is removed first).
    """
    if len(name) > MAX_NAME_BYTES:
        raise OSError(f"object name of {len(name)} bytes exceeds {MAX_NAME_BYTES}")
    if native_io and fileio.NATIVE_DIGESTS:  # one native call: digest, write, sync, rename
        length = sum(len(p) for p in pieces)
        head = header_template(name, length, meta, stamp)
        if checksum is not None:
            head[DIGEST_AT : DIGEST_AT + 16] = checksum
        err = fileio.write_file(
            temp,
            path,
            head,
            pieces,
            sync=sync,
            digest_offset=DIGEST_AT if checksum is None else None,
            digest_prefix=name,
        )
        if err:
            raise OSError(err, os.strerror(err), temp)
        return len(head) + length

    def fill(fd: int) -> int:
        header = pack_header(name, pieces, meta, stamp, checksum)
        _writev_all(fd, [memoryview(header), *pieces])
        if sync:
            os.fdatasync(fd)
        return len(header) + sum(len(p) for p in pieces)

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


def read_meta(path: str, name: bytes) -> bytes | None:
    """The metadata in the header of the object ``name`` stored at ``path``, verified, read
    without its payload; None when the file is missing, is not that object, or carries none."""
    try:
        fd = os.open(path, _O_READ)
    except OSError:
        return None
    try:
        head = os.pread(fd, header_size(len(name)), 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    header = Header.parse(head)
    return None if header is None else header.meta(head, name)


def stamp_in_file(path: str) -> tuple[os.stat_result, int] | None:
    """The object file at ``path`` (its ``fstat``) and its write stamp; None when there is
    none, or it is not one of ours."""
    try:
        fd = os.open(path, _O_READ)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        header = Header.parse(os.pread(fd, HEADER.size, 0)) if stat.S_ISREG(st.st_mode) else None
        if header is None:
            return None
        tail = os.pread(fd, 8, header.size - 8)
        return (st, stamp_of(tail)) if len(tail) == 8 else None
    except OSError:
        return None
    finally:
        os.close(fd)


def read_name(path: str) -> bytes | None:
    """The name in an object file's header; None when the file is not a valid object file."""
    try:
        fd = os.open(path, _O_READ)
    except OSError:
        return None
    try:
        header = Header.parse(os.pread(fd, HEADER.size, 0))
        if header is None:
            return None
        name = os.pread(fd, header.name_len, HEADER.size)
        return name if len(name) == header.name_len else None
    except OSError:
        return None
    finally:
        os.close(fd)
