"""The ``file`` backend: kvcore's embedded default store, one file per object under a root.

Batches fan out over a small thread pool (the calling thread works too): each object is one
``open``/``preadv``/``close`` straight into the caller's buffer on reads (``O_DIRECT`` when
the page cache does not hold it, see :class:`~kv_file.objio.DirectReads`), and one
``writev`` of header and buffer to a temp file plus a ``rename`` on writes. ``preadv``,
``writev`` and xxhash release the GIL, so threads overlap the copies and checksums.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import kvcore
from kv_file.config import FileConfig, safe_namespace
from kv_file.index import Index
from kv_file.names import load_names, save_names
from kv_file.objfile import encode_name, header_size
from kv_file.objio import DirectReads, ReadOutcome, read_object, write_object
from kv_file.paths import StoreDir, name_digest
from kvcore import BlockRequest, leading_run

__all__ = ["FileBackend"]

log = logging.getLogger("kvcore.file")

#: Batches smaller than this run in the calling thread: a thread hand-off costs more.
_INLINE_BYTES = 1 << 20
#: Queries check their deadline every this many blocks.
_QUERY_DEADLINE_STRIDE = 1024
#: Blocks whose names a query hashes at once when the index has not learned them yet.
_QUERY_HASH_CHUNK = 512

_READ_COUNTERS = {
    ReadOutcome.OK: "read_hits",
    ReadOutcome.MISSING: "read_missing",
    ReadOutcome.WRONG_SIZE: "read_wrong_size",
    ReadOutcome.COLLISION: "read_collisions",
    ReadOutcome.CORRUPT: "corrupt_removed",
}


class FileBackend:
    """Key-addressed, host-I/O, persistent, shareable by processes on one host."""

    config_model = FileConfig
    capabilities = kvcore.Capabilities(
        addressing="key", io="host", persistent=True, shared=True, token_index=False
    )

    def __init__(self, config: FileConfig, context: kvcore.BackendContext) -> None:
        self.config = config
        namespace = config.namespace or safe_namespace(context.namespace, "context namespace")
        self._dir = StoreDir(config.root, namespace)
        self._dir.create()
        self._sync = config.fsync != "none"
        self._sync_dirs = config.fsync == "data_and_dir"
        self._index = Index(config.capacity_bytes, config.high_watermark, config.low_watermark)
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self._direct = DirectReads(config.direct_reads)
        self._cpus = _usable_cpus()
        self._count(temps_removed=self._dir.remove_stale_temps())
        self._index.load((f.digest, f.size, f.mtime_ns) for f in self._dir.scan())
        self._index.name_all(load_names(self._dir.names_path))
        self._names_saved = self._index.names_changed
        self._delete(self._index.reserve(0)[1])  # the capacity may have been lowered
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kv_file-io")
        self._stop = threading.Event()
        self._rescanner: threading.Thread | None = None
        if config.rescan_interval_s > 0:
            self._rescanner = threading.Thread(
                target=self._rescan_loop, name="kv_file-rescan", daemon=True
            )
            self._rescanner.start()
        log.info(
            "kv_file store at %s: %d objects, %d of %d bytes, fsync=%s",
            self._dir.path,
            len(self._index),
            self._index.used,
            config.capacity_bytes,
            config.fsync,
        )

    # -- hooks -----------------------------------------------------------------------------

    @kvcore.hookimpl
    def kvcore_query(self, request: BlockRequest) -> int:
        by_name = self._index.by_name  # probed without the lock: a dict probe is atomic
        for i, names in enumerate(request.object_names):
            for name in names:
                if name not in by_name:
                    return self._query_unlearned(request, i)
            if i % _QUERY_DEADLINE_STRIDE == _QUERY_DEADLINE_STRIDE - 1 and request.expired():
                return i + 1
        return request.num_blocks

    def _query_unlearned(self, request: BlockRequest, start: int) -> int:
        """The rest of a query from block ``start``, whose names the index has not all learned.

        Names are hashed a chunk at a time and learned under one lock; the first digest the
        index lacks is looked for on disk (another process may have written it since the last
        scan) before it ends the run.
        """
        parts = len(request.parts)
        index = self._index
        i = start
        while i < request.num_blocks:
            chunk = [n for block in request.object_names[i : i + _QUERY_HASH_CHUNK] for n in block]
            digests = [name_digest(encode_name(n)) for n in chunk]
            known = index.learn_many(chunk, digests)
            if known < len(chunk):
                name, digest = chunk[known], digests[known]
                if not self._adopt(self._dir.object_path(digest), digest, name):
                    return i + known // parts
                i += known // parts  # adopted: go on from its block
            else:
                i += len(chunk) // parts
            if request.expired():
                return i
        return request.num_blocks

    @kvcore.hookimpl
    def kvcore_read(self, request: BlockRequest) -> int:
        host = _host_buffers(request)
        names = request.object_names
        parts = len(request.parts)
        index = self._index

        def read_one(k: int) -> str:
            i, j = divmod(k, parts)
            name = names[i][j]
            raw = encode_name(name)
            digest = self._digest(name, raw)
            outcome = read_object(
                self._dir.object_path(digest),
                raw,
                host.memoryview(i, j),
                direct=self._direct,
            )
            if outcome is ReadOutcome.OK:
                if not index.learn(name, digest):  # written by another process: adopt it
                    index.add(digest, header_size(len(raw)) + host.nbytes[j], name, reserved=False)
                index.touch(digest, time.time_ns())
            elif outcome in (ReadOutcome.MISSING, ReadOutcome.CORRUPT):
                index.drop(digest)
            return _READ_COUNTERS[outcome]

        outcomes = self._run(request, read_one, host.nbytes, self._read_workers(request))
        return leading_run([o == "read_hits" for o in outcomes], parts)

    @kvcore.hookimpl
    def kvcore_write(self, request: BlockRequest) -> int:
        host = _host_buffers(request)
        names = request.object_names
        parts = len(request.parts)
        index = self._index
        written_dirs: dict[str, list[int]] = {}

        def write_one(k: int) -> str:
            i, j = divmod(k, parts)
            name = names[i][j]
            if name in index.by_name:
                return "write_skipped"  # names are content-derived: same name, same bytes
            raw = encode_name(name)
            digest = name_digest(raw)
            path = self._dir.object_path(digest)
            if index.learn(name, digest) or self._adopt(path, digest, name):
                return "write_skipped"
            size = header_size(len(raw)) + host.nbytes[j]
            fits, victims = index.reserve(size)
            self._delete(victims)
            if not fits:
                return "write_refused"
            try:
                write_object(
                    path,
                    self._dir.temp_path(digest),
                    raw,
                    host.memoryview(i, j),
                    sync=self._sync,
                )
            except OSError as exc:
                index.release(size)
                log.debug("kv_file write of %r failed: %s", name, exc)
                return "write_errors"
            index.add(digest, size, name, reserved=True)
            if self._sync_dirs:
                written_dirs.setdefault(self._dir.subdir(digest), []).append(k)
            return "write_stored"

        # Synced writes wait on the disk; unsynced ones are copies into the page cache.
        workers = self.config.io_threads if self._sync else min(self.config.io_threads, self._cpus)
        outcomes = self._run(request, write_one, host.nbytes, workers)
        for d, ks in written_dirs.items():  # one directory fsync per batch, not per object
            try:
                _fsync_dir(d)
            except OSError as exc:
                log.debug("kv_file fsync of directory %s failed: %s", d, exc)
                for k in ks:
                    outcomes[k] = "write_errors"
        ok = ("write_stored", "write_skipped")
        return leading_run([o in ok for o in outcomes], parts)

    @kvcore.hookimpl
    def kvcore_stats(self) -> dict[str, float]:
        index = self._index
        with self._counts_lock:
            out = {k: float(v) for k, v in self._counts.items()}
        with index.lock:
            out.update(
                objects=float(len(index.lru)),
                bytes_used=float(index.used),
                capacity_bytes=float(index.capacity),
                evictions=float(index.evictions),
            )
        out["direct_reads"] = float(self._direct.count)
        return out

    @kvcore.hookimpl
    def kvcore_raw_baseline(self, ptr: int, nbytes: int) -> dict[str, float]:
        """What the disk gives without kvcore: one sequential file in this root, same sync."""
        view = memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")
        path = os.path.join(self._dir.path, f".raw-baseline-{os.getpid()}.tmp")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            t0 = time.perf_counter()
            done = 0
            while done < nbytes:
                done += os.pwrite(fd, view[done:], done)
            if self._sync:
                os.fdatasync(fd)
            t1 = time.perf_counter()
            done = 0
            while done < nbytes:
                done += os.preadv(fd, [view[done:]], done)
            t2 = time.perf_counter()
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
        gib = nbytes / 2**30
        return {"write_gbps": gib / (t1 - t0), "read_gbps": gib / (t2 - t1)}

    @kvcore.hookimpl
    def kvcore_close(self) -> None:
        self._stop.set()
        if self._rescanner is not None:
            self._rescanner.join()
        self._pool.shutdown(wait=True)
        self.save_recency()
        self.save_names()

    # -- what a restart rebuilds from ------------------------------------------------------

    def save_names(self) -> None:
        """Snapshot the learned names (see :mod:`kv_file.names`) if they changed since."""
        changed = self._index.names_changed
        if changed == self._names_saved:
            return
        try:
            save_names(self._dir.names_path, self._dir.names_temp_path(), self._index.named())
            self._names_saved = changed
        except OSError as exc:  # a hint only: the next start hashes names instead
            log.warning("kv_file could not save its name snapshot: %s", exc)

    def save_recency(self) -> int:
        """Write the times of recent read hits to the files' mtimes, which a restart orders by.

        Done in batches (every rescan interval and at close) rather than per read: a ``utime``
        per object cost ~6% of warm read throughput. A crash loses at most one interval of
        recency, which only makes eviction after the restart slightly less exact.
        """
        touched = self._index.take_touched()
        for digest, when in touched.items():
            with contextlib.suppress(OSError):  # evicted meanwhile, or a read-only file system
                os.utime(self._dir.object_path(digest), ns=(when, when))
        return len(touched)

    # -- cross-process visibility ----------------------------------------------------------

    def rescan(self) -> None:
        """Pick up objects other processes wrote and forget those they evicted."""
        index = self._index
        started = index.stamp()
        with index.lock:
            known = set(index.lru)
        seen: set[int] = set()
        fresh = []
        for f in self._dir.scan(skip=known):
            seen.add(f.digest)
            if f.size >= 0:
                fresh.append((f.digest, f.size, f.mtime_ns))
        index.load(fresh)
        for digest in known - seen:
            index.drop(digest, older_than=started)
        self._delete(index.reserve(0)[1])
        self._count(rescans=1, adopted=len(fresh))

    def _rescan_loop(self) -> None:
        while not self._stop.wait(self.config.rescan_interval_s):
            try:
                self.save_recency()
                self.save_names()
                self.rescan()
            except Exception as exc:  # keep scanning later; a failed scan only delays adoption
                log.warning("kv_file rescan of %s failed: %r", self._dir.path, exc)

    def _adopt(self, path: str, digest: int, name: str) -> bool:
        """Index a file another process wrote (its header is verified when it is read)."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        self._index.add(digest, st.st_size, name, reserved=False)
        self._count(adopted=1)
        return True

    # -- plumbing --------------------------------------------------------------------------

    def _digest(self, name: str, raw: bytes | None = None) -> int:
        """The file digest of ``name``: from the index when learned, else hashed."""
        digest = self._index.by_name.get(name)
        return digest if digest is not None else name_digest(raw or encode_name(name))

    def _read_workers(self, request: BlockRequest) -> int:
        """Threads for a read: all ``io_threads`` when it goes to the disk (each one mostly
        waits on a direct read), one per core when the page cache holds it (each one copies,
        and more threads than cores measured slower). The batch's first object decides."""
        if not self._direct.enabled or request.num_blocks == 0:
            return min(self.config.io_threads, self._cpus)
        name = request.object_names[0][0]
        if self._direct.path_cached(self._dir.object_path(self._digest(name))):
            return min(self.config.io_threads, self._cpus)
        return self.config.io_threads

    def _run(
        self,
        request: BlockRequest,
        one: Callable[[int], str],
        nbytes: tuple[int, ...],
        workers: int,
    ) -> list[str]:
        """Call ``one(k)`` for every object ``k`` (flat ``[block][part]`` order) in parallel.

        Workers pull the next object from a shared counter, stop at the deadline, and skip
        objects past the first failed block (they could not count). The call returns only
        when no worker touches the caller's buffers any more: abandoning in-flight I/O would
        let it write into memory the caller already reuses. Each worker finishes at most the
        one object it holds when the deadline passes.
        """
        parts = len(request.parts)
        total = request.num_blocks * parts
        outcomes = ["skipped"] * total
        if total == 0:
            return outcomes
        counter = itertools.count()
        stop = [total]  # objects from here on cannot count: their block or an earlier failed
        deadline = request.deadline
        clock = time.monotonic
        good = ("read_hits", "write_stored", "write_skipped")

        def worker() -> None:
            for k in counter:
                if k >= stop[0]:
                    return
                if clock() >= deadline:
                    outcomes[k] = "deadline"
                    stop[0] = min(stop[0], k - k % parts)
                    return
                try:
                    outcome = one(k)
                except OSError as exc:
                    log.debug("kv_file I/O error on %r: %s", request.object_names[k // parts], exc)
                    outcome = "io_errors"
                outcomes[k] = outcome
                if outcome not in good:
                    stop[0] = min(stop[0], k - k % parts)

        workers = min(workers, total)
        if workers == 1 or sum(nbytes) * request.num_blocks < _INLINE_BYTES:
            worker()
        else:
            futures = [self._pool.submit(worker) for _ in range(workers - 1)]
            try:
                worker()
            finally:
                for f in futures:
                    f.result()
        self._count(**Counter(o for o in outcomes if o != "skipped"))
        return outcomes

    def _delete(self, digests: list[int]) -> None:
        for digest in digests:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._dir.object_path(digest))

    def _count(self, **amounts: int) -> None:
        with self._counts_lock:
            self._counts.update(amounts)


def _host_buffers(request: BlockRequest) -> kvcore.HostBuffers:
    host = request.host
    if host is None:
        raise ValueError("request.host is None: the file backend reads and writes host buffers")
    if len(host.nbytes) != len(request.parts):
        raise ValueError(
            f"request.host.nbytes has {len(host.nbytes)} sizes for {len(request.parts)} parts"
        )
    if len(host.ptrs) != request.num_blocks or len(request.object_names) != request.num_blocks:
        raise ValueError(
            f"request.host.ptrs has {len(host.ptrs)} blocks and request.object_names "
            f"{len(request.object_names)} for {request.num_blocks} block keys"
        )
    for i, (ptrs, names) in enumerate(zip(host.ptrs, request.object_names, strict=True)):
        if len(ptrs) != len(request.parts) or len(names) != len(request.parts):
            raise ValueError(
                f"request.host.ptrs[{i}] / object_names[{i}] must have one entry per part "
                f"({len(request.parts)})"
            )
    return host


def _usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
