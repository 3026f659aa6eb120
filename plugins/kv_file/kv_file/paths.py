"""Where objects live: ``<root>/<namespace>/<2 hex>/<30 hex>.kv``, named by a hash of the name.

No part of an object's name reaches the file system: ``../``, ``/``, NUL or 10 KB names all
become 32 hex digits. The full name is kept in the file's header and compared on every read,
so a hash collision can only ever be a miss.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

__all__ = ["FANOUT", "StoreDir", "discard", "name_digest"]

FANOUT = 256
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
#: A temp file this old is abandoned whoever wrote it (another host, a reused pid).
STALE_TMP_S = 3600.0
_HOST = xxhash.xxh3_64_hexdigest(socket.gethostname().encode())[:8]


def _hex(digest: int) -> str:
    """A digest as its file's 32 hex digits (``bytes.hex`` takes half of what ``format``
    takes: a batch names thousands of files)."""
    return digest.to_bytes(16, "big").hex()


def name_digest(name: bytes) -> int:
    return xxhash.xxh3_128_intdigest(name)


@dataclass(frozen=True, slots=True)
class Found:
    """One object file seen by a scan."""

    digest: int
    size: int
    mtime_ns: int


class StoreDir:
    """The directory tree of one namespace. Directories are 0700, files 0600."""

    def __init__(self, root: str, namespace: str) -> None:
        self.root = os.path.abspath(root)
        self.path = os.path.join(self.root, namespace)
        self._subdirs = [os.path.join(self.path, f"{i:02x}") for i in range(FANOUT)]
        self._seq = 0

    def create(self) -> None:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        for d in (self.path, *self._subdirs):
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, 0o700)

    def directory_bytes(self) -> int:
        """What the store's directories take on the file system (ext4: a block each; tmpfs,
        btrfs and small XFS directories: none)."""
        total = 0
        for d in (self.path, *self._subdirs):
            with contextlib.suppress(OSError):
                total += os.lstat(d).st_blocks * 512
        return total

    def meta_temp_path(self, stem: str) -> str:
        """A fresh temp name for a file of the store's own (the journal) in its directory."""
        return self._temp(self.path, stem)

    def subdir(self, digest: int) -> str:
        return self._subdirs[digest >> 120]

    def object_path(self, digest: int) -> str:
        return f"{self._subdirs[digest >> 120]}/{_hex(digest)}{SUFFIX}"

    def temp_path(self, digest: int) -> str:
        """A fresh temp name beside the object: same directory, so the rename is atomic."""
        return self._temp(self._subdirs[digest >> 120], _hex(digest))

    def temp_paths(self, digests: list[int]) -> list[str]:
        """:meth:`temp_path` of each digest: fresh names, the process and thread told once."""
        self._seq += 1  # one sequence number for the batch; each name has its own position
        tag = f"{_HOST}.{os.getpid()}.{threading.get_native_id()}.{self._seq}x"
        subdirs = self._subdirs
        return [
            f"{subdirs[d >> 120]}/{_hex(d)}.{tag}{k}{TMP_SUFFIX}" for k, d in enumerate(digests)
        ]

    def object_paths(self, digests: list[int]) -> list[str]:
        """:meth:`object_path` of each digest."""
        subdirs = self._subdirs
        return [f"{subdirs[d >> 120]}/{_hex(d)}{SUFFIX}" for d in digests]

    def _temp(self, directory: str, stem: str) -> str:
        """``<stem>.<host>.<pid>.<thread>.<seq>.tmp``: what remove_stale_temps parses (a batch's
        ``<seq>`` is ``<batch>x<position>``, :meth:`temp_paths`)."""
        self._seq += 1  # racy under threads, but the thread id below keeps names unique
        return (
            f"{directory}/{stem}.{_HOST}.{os.getpid()}.{threading.get_native_id()}."
            f"{self._seq}{TMP_SUFFIX}"
        )

    def scan(
        self, skip: set[int] | frozenset[int] = frozenset(), strays: list[str] | None = None
    ) -> Iterator[Found]:
        """Every regular object file (stat'ed unless its digest is in ``skip``, then size -1).

        Anything else under an object's name (a symlink, a directory, a FIFO) is never an
        object: its path goes to ``strays``, for the caller to remove.
        """
        for d in self._subdirs:
            try:
                it = os.scandir(d)
            except FileNotFoundError:
                continue
            with it:
                for entry in it:
                    name = entry.name
                    if not name.endswith(SUFFIX) or len(name) != 32 + len(SUFFIX):
                        continue
                    try:
                        digest = int(name[:32], 16)
                        regular = entry.is_file(follow_symlinks=False)  # d_type: no syscall
                    except (ValueError, OSError):
                        continue
                    if not regular:
                        if strays is not None:
                            strays.append(entry.path)
                        continue
                    if digest in skip:
                        yield Found(digest, -1, 0)
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # evicted by another process meanwhile
                    yield Found(digest, st.st_size, st.st_mtime_ns)

    def remove_stale_temps(self) -> int:
        """Delete temp files left by dead writers on this host, or abandoned long ago."""
        removed = 0
        now = time.time()
        for d in (self.path, *self._subdirs):
            try:
                names = [n for n in os.listdir(d) if n.endswith(TMP_SUFFIX)]
            except FileNotFoundError:
                continue
            for n in names:
                path = os.path.join(d, n)
                if _temp_is_stale(n, path, now):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                        removed += 1
        return removed


def discard(path: str, seen: os.stat_result | None = None) -> bool:
    """Remove whatever is at ``path`` (a directory with its contents; a symlink, never its
    target). With ``seen``, only if it is still that file, not a fresh object renamed over it.
    Returns whether something was removed."""
    try:
        now = os.lstat(path)
        if seen is not None and (now.st_ino, now.st_dev) != (seen.st_ino, seen.st_dev):
            return False
        if stat.S_ISDIR(now.st_mode):
            shutil.rmtree(path)  # never follows symlinks inside it
        else:
            os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _temp_is_stale(name: str, path: str, now: float) -> bool:
    parts = name.split(".")
    try:
        mtime = os.stat(path).st_mtime
    except FileNotFoundError:
        return False
    if now - mtime > STALE_TMP_S:
        return True
    if len(parts) != 6 or parts[1] != _HOST:
        return False  # another host's writer may still be alive
    try:
        pid = int(parts[2])
    except ValueError:
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
