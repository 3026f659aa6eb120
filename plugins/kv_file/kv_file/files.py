"""The store's object files against the catalog: what is at an object's path, and what to do
about a file no record told of.

The index is a cache of what is on disk, never trusted alone where it is cheap to check: before
a write skips an object, and when a query meets a name the index has not learned, an ``lstat``
of the object's path decides (:meth:`ObjectFiles.look`). A regular file of the right size is
the object its name promises (the header is verified when it is read) and is adopted into the
catalog if no record told of it; anything else at that path is removed and forgotten.

Also here: the file-system helpers the backend and :mod:`kv_file.removal` share (evicted files
moved off their names, directory fsyncs, OS errors described in one line).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

import kvcore
from kv_file.catalog import Catalog
from kv_file.objfile import encode_name, header_size
from kv_file.paths import StoreDir, discard, name_digest
from kvcore import BlockRequest

__all__ = ["QUERY_HASH_CHUNK", "ObjectFiles", "describe", "fsync_dir", "retire_files"]

#: Blocks whose names a query hashes at once when the index has not learned them yet.
QUERY_HASH_CHUNK = 512


class ObjectFiles:
    """The object files of one opened store, as its catalog sees them.

    :param payload: payload bytes of each part by the layout (None: no layout); an object of
        its name's part has exactly this many, anything else under that name is not the object.
    :param sync_dirs: removals are made durable with directory fsyncs (``fsync=data_and_dir``).
    """

    def __init__(
        self,
        store_dir: StoreDir,
        catalog: Catalog,
        payload: dict[str, int] | None,
        counters: kvcore.Counters,
        failures: kvcore.OnceLogger,
        *,
        sync_dirs: bool,
    ) -> None:
        self.store_dir = store_dir
        self.catalog = catalog
        self.payload = payload
        self.counters = counters
        self.failures = failures
        self.sync_dirs = sync_dirs

    def look(self, digest: int, size: int | None) -> os.stat_result | None:
        """The ``lstat`` of ``digest``'s object file if it is a regular file (of ``size`` bytes,
        when given): as far as metadata tells, the object its name promises (the header is
        verified when it is read). Otherwise None, and the index forgets the digest after
        whatever else is there was removed."""
        path = self.store_dir.object_path(digest)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            index = self.catalog.index
            if index.size_of(digest) is not None:  # indexed: deleted without a record
                self.catalog.gone([digest])  # (by hand, a crash); unknown: nothing to tell
            return None
        if stat.S_ISREG(st.st_mode) and size in (None, st.st_size):
            return st
        self.discard(path, st, digest)
        return None

    def adopt(self, digest: int, name: str, size: int | None) -> bool:
        """Index the file at ``digest``'s path for ``name`` if :meth:`look` finds the object
        there (another process may have written it)."""
        st = self.look(digest, size)
        if st is None:
            return False
        self.catalog.adopted([(digest, st.st_size, encode_name(name))])
        return True

    def learn(self, request: BlockRequest, start: int) -> int:
        """The rest of a query from block ``start``, whose names the index has not all learned.

        Names are hashed a chunk at a time and learned under one lock (with the layout, only
        for files of the size the name's part has); the first one that does not qualify is
        looked for on disk (another process may have written it since the last scan) before
        it ends the run.
        """
        parts = request.parts
        nparts = len(parts)
        payload = self.payload
        index = self.catalog.index
        i = start
        while i < request.num_blocks:
            chunk = [n for block in request.object_names[i : i + QUERY_HASH_CHUNK] for n in block]
            raws = [encode_name(n) for n in chunk]
            digests = [name_digest(r) for r in raws]
            sizes = None
            if payload is not None:  # None for a part the layout does not have: any size
                part_sizes = [payload.get(p) for p in parts]
                sizes = [
                    None if (n := part_sizes[k % nparts]) is None else header_size(len(r)) + n
                    for k, r in enumerate(raws)
                ]
            known = index.learn_many(chunk, digests, sizes)
            if known < len(chunk):
                size = None if sizes is None else sizes[known]
                if not self.adopt(digests[known], chunk[known], size):
                    return i + known // nparts
                i += known // nparts  # adopted: go on from its block
            else:
                i += len(chunk) // nparts
            if request.expired():
                return i
        return request.num_blocks

    def hold_stored(self, digest: int, name: bytes | None, size: int) -> bool:
        """Whether a write may skip this object: :meth:`look` finds it, ``size`` bytes (names
        are content-derived, so it holds the same bytes). It is then pinned until the write
        returns, so no eviction of this process removes it before the write acknowledges it."""
        if self.look(digest, size) is None:
            return False
        index = self.catalog.index
        if index.size_of(digest) != size:  # in place, but no record told of it
            self.catalog.adopted([(digest, size, name)])
        if not index.hold(digest):
            return False  # evicted since
        path = self.store_dir.object_path(digest)
        if os.path.lexists(path):  # pinned: no eviction of ours now
            return True
        index.unpin([digest])  # an eviction deleted it between the two looks
        return False

    def discard(self, path: str, seen: os.stat_result, digest: int) -> None:
        """Remove what is at an object's path that is not the object, then forget it."""
        try:
            if discard(path, seen):
                self.counters.add("foreign_removed")
        except OSError as exc:
            self.failures.warning(
                ("discard", type(exc)), "kv_file cannot remove %s: %s", path, describe(exc)
            )
        self.catalog.gone([digest])

    def save_recency(self) -> int:
        """Write the times of recent read hits to the files' mtimes, which a restart orders by.

        Done in batches (every rescan interval and at close) rather than per read: a ``utime``
        per object cost ~6% of warm read throughput. A crash loses at most one interval of
        recency, which only makes eviction after the restart slightly less exact.
        """
        touched = self.catalog.index.take_touched()
        for digest, when in touched.items():
            with contextlib.suppress(OSError):  # evicted meanwhile, or a read-only file system
                os.utime(self.store_dir.object_path(digest), ns=(when, when))
        return len(touched)


def retire_files(store_dir: StoreDir, digests: list[int]) -> list[tuple[int, str]]:
    """Move evicted objects' files off their names, to temp names beside them (the catalog
    deletes those later, outside the journal's lock); returns the digests and temp paths of
    those moved."""
    moved = []
    for digest in digests:
        temp = store_dir.temp_path(digest)
        with contextlib.suppress(FileNotFoundError):
            os.rename(store_dir.object_path(digest), temp)
            moved.append((digest, temp))
    return moved


def describe(exc: OSError) -> str:
    """``[Errno 28] No space left on device`` style, with the errno's name."""
    code = errno.errorcode.get(exc.errno or 0, "")
    return f"{exc.strerror or exc} ({code})" if code else str(exc)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
