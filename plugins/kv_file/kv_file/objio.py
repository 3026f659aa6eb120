"""Reading and writing one object file, straight from and into the caller's buffer."""

from __future__ import annotations

import contextlib
import enum
import os

from kv_file.objfile import HEADER, MAX_NAME_BYTES, Header, checksum, header_size, pack_header

__all__ = ["ReadOutcome", "read_object", "write_object"]

_O_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
_O_TEMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


class ReadOutcome(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no file (never written, or evicted by someone)
    WRONG_SIZE = "wrong_size"  # a valid object of another size than the buffer: a plain miss
    COLLISION = "collision"  # a valid object of another name with the same hash
    CORRUPT = "corrupt"  # failed verification: the file was removed


def read_object(path: str, name: bytes, view: memoryview, *, touch: bool) -> ReadOutcome:
    """Fill ``view`` with the object stored at ``path`` under ``name``, verified.

    One ``preadv`` puts the header in a small buffer and the payload directly in ``view``;
    the checksum is then computed over ``view`` itself. ``touch`` refreshes the file's
    mtime, which is the recency a restart rebuilds LRU order from.
    """
    try:
        fd = os.open(path, _O_READ)
    except FileNotFoundError:
        return ReadOutcome.MISSING
    try:
        st = os.fstat(fd)
        hsize = header_size(len(name))
        if st.st_size != hsize + len(view):
            return _classify(fd, path, st, name, len(view))
        head = bytearray(hsize)
        got = os.preadv(fd, [head, view], 0)
        header = Header.parse(head)
        if (
            got != st.st_size
            or header is None
            or header.name_len != len(name)
            or header.length != len(view)
            or head[HEADER.size : HEADER.size + len(name)] != name
        ):
            return _classify(fd, path, st, name, len(view))
        if checksum(name, view) != header.digest:
            return _remove_corrupt(fd, path, st)
        if touch:
            with contextlib.suppress(OSError):  # recency is a hint; a read-only fs still reads
                os.utime(fd)
        return ReadOutcome.OK
    finally:
        os.close(fd)


def write_object(path: str, temp: str, name: bytes, view: memoryview, *, sync: bool) -> int:
    """Write ``view`` under ``name`` to a temp file, sync it if asked, rename it to ``path``.

    Readers see the old file or the new one, never a partial one. Returns the file's size.
    Raises OSError (the temp file is removed first).
    """
    if len(name) > MAX_NAME_BYTES:
        raise OSError(f"object name of {len(name)} bytes exceeds {MAX_NAME_BYTES}")
    header = pack_header(name, view)
    total = len(header) + len(view)
    fd = os.open(temp, _O_TEMP, 0o600)
    try:
        try:
            done = os.writev(fd, [header, view])
            while done < total:  # short writes: rare, but legal
                if done < len(header):
                    done += os.write(fd, header[done:])
                else:
                    done += os.write(fd, view[done - len(header) :])
            if sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.rename(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return total


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
