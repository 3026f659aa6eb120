"""A counter of removals shared by every process that has one namespace directory open.

Each process answers queries from its own in-memory index, which another process's ``remove``
or ``clear`` would otherwise leave stale until the next scan: a query would count blocks that
are gone. So a process that removes objects bumps this counter (an 8-byte file, mapped
shared), and every process compares it with the value it last saw before it answers a query:
one memory read, no system call. When it changed, the process forgets the files that are
gone (a directory scan) before answering.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
from collections.abc import Iterator

__all__ = ["RemovalCounter"]

log = logging.getLogger("kvcore.file")

_SIZE = 8


class RemovalCounter:
    """The shared counter in ``path`` (created 0600 if missing). On a store this process cannot
    write (a read-only root) the counter is private: such a process removes nothing, and it
    sees others' removals as read misses."""

    def __init__(self, path: str) -> None:
        self._fd: int | None = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            log.info("kv_file: %s is not writable (%s); removals are not shared", path, exc)
            self._map = mmap.mmap(-1, _SIZE)
            return
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)  # zero-filled; a racing creator truncates to the same size
            self._map = mmap.mmap(fd, _SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def value(self) -> int:
        return int.from_bytes(self._map[:_SIZE], "little")

    def bump(self) -> tuple[int, int]:
        """Count one removal; returns the values before and after (under an exclusive lock,
        so concurrent bumps from several processes are never lost)."""
        with self._locked():
            before = self.value()
            after = (before + 1) % (1 << 64)
            self._map[:_SIZE] = after.to_bytes(_SIZE, "little")
        return before, after

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self._fd is None:
            yield
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
