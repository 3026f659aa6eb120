"""The ``file`` backend: kvcore's embedded default store, one file per object under a root.

Batches fan out over a small thread pool (the calling thread works too): each object is one
``open``/``preadv``/``close`` straight into the caller's memory on reads (``O_DIRECT`` when
the page cache does not hold it, see :class:`~kv_file.objio.DirectReads`), and one
``writev`` of header and payload to a temp file plus a ``rename`` on writes. The caller's
memory is a staging region per object, or the engine's own host-resident cache blocks, one
piece per layer (segmented host buffers): the vectored calls take either as it is. ``preadv``,
``writev`` and xxhash release the GIL, so threads overlap the copies and checksums.

The index is a cache of what is on disk, never trusted alone where it is cheap to check: a
write skips an object only after an ``lstat`` shows a regular file of the right size; a query
counts a name only for a file of the size the layout gives it; a read verifies everything and
removes what is not the object its name promises (a torn or damaged file, an object of another
size or at another object's place, a symlink, a directory, a FIFO), so a rewrite lands.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import threading
import time
from collections.abc import Callable

import kvcore
from kv_file.admission import StoreAdmission
from kv_file.batch import READ_COUNTERS, Batches, answer
from kv_file.catalog import Catalog
from kv_file.config import FileConfig, safe_namespace
from kv_file.files import ObjectFiles, describe, fsync_dir, retire_files
from kv_file.handover import HandOver
from kv_file.model import StoreModel
from kv_file.objfile import encode_name, header_size
from kv_file.objio import DirectReads, ReadOutcome, read_meta, read_object, write_object
from kv_file.paths import StoreDir, name_digest
from kv_file.removal import clear_objects, remove_blocks
from kv_file.watch import Watch
from kvcore import BlockRequest
from kvcore.evictions import EvictionSink, sink_caller
from kvcore.keys import name_columns
from kvcore.threads import start_thread, usable_cpus

__all__ = ["FileBackend"]

log = logging.getLogger("kvcore.file")

#: Queries check their deadline every this many blocks.
_QUERY_DEADLINE_STRIDE = 1024


class FileBackend:
    """Key-addressed, host-I/O, persistent, shareable by processes on one host."""

    config_model = FileConfig
    # segmented_host: preadv/writev take an engine's per-layer pieces of a block as they are;
    # checksums: every read is verified against the xxh3-128 in the object's header
    #: this store's capacity accounting in metadata, for ``kvcore replay --simulate``
    store_model = StoreModel
    capabilities = kvcore.Capabilities(
        addressing="key",
        io="host",
        persistent=True,
        shared=True,
        segmented_host=True,
        checksums=True,
        block_meta=True,
    )

    def __init__(self, config: FileConfig, context: kvcore.BackendContext) -> None:
        self.config = config
        directory = config.namespace or safe_namespace(context.namespace, "context namespace")
        self._dir = StoreDir(config.root, directory)
        try:
            self._dir.create()
        except OSError as exc:  # one line naming the setting, not a raw OS error
            failed = exc.filename or config.root
            why = describe(exc)
            parent = os.path.dirname(os.path.abspath(failed))
            if exc.errno == errno.ENOENT and os.path.isdir(parent):
                why = f"the file system at {parent!r} does not let directories be created"
            raise kvcore.ConfigError(
                f"invalid config for backend 'file':\n  root: {config.root!r} cannot hold a "
                f"store: creating {failed!r} failed: {why}"
            ) from None
        # every object name starts with the engine's namespace; a directory may hold several
        # (a configured `namespace` puts engines of any namespace into one directory)
        self._name_prefix = encode_name(f"{context.namespace}/")
        # the directory named for the engine's namespace holds only its objects, whatever
        # names callers chose (an adapter may keep an engine's own, FastDeploy's say)
        self._own_directory = directory == context.namespace
        layout = context.layout
        #: payload bytes of each part, when the layout is known: an object of its name's part
        #: has exactly this many, anything else under that name is not the object
        self._payload = {p: layout.part_bytes(p) for p in layout.parts} if layout else None
        self._sync = config.fsync != "none"
        self._sync_dirs = config.fsync == "data_and_dir"
        self._counters = kvcore.Counters()
        self._failures = kvcore.OnceLogger(log)
        self._direct = DirectReads(config.direct_reads)
        self._cpus = usable_cpus()
        self._counters.add("temps_removed", self._dir.remove_stale_temps())
        # payload sizes an object of this layout can have (a file of any other is never named)
        fits = None if self._payload is None else frozenset(self._payload.values())
        #: what the directory holds, the same in every process that has it open
        self._catalog = Catalog(
            self._dir,
            config.capacity_bytes,
            config.high_watermark,
            config.low_watermark,
            fits=fits,
            retire_files=functools.partial(retire_files, self._dir),
            counters=self._counters,
        )
        self._index = self._catalog.index
        self._files = ObjectFiles(
            self._dir,
            self._catalog,
            self._payload,
            self._counters,
            self._failures,
            sync_dirs=self._sync_dirs,
        )
        # A store over its capacity (it was lowered, or a crash left files) is brought down
        # to it by the first call, not here: a stack that opens this store attaches its
        # hand-over (kvcore_evict_to) before anything else, and what that first eviction
        # takes must be handed over too (see _settle).
        self._unsettled = True
        self._admission = StoreAdmission(
            config.admission,
            self._index,
            self._payload,
            self._catalog.journal.reserved,
            self._catalog.own_bytes,
            doorkeeper_factor=config.admission_doorkeeper,
            sample_rate=config.admission_sample_rate,
        )
        self._batches = Batches(config.io_threads, self._counters, self._failures)
        self._stop = threading.Event()
        self._rescanner: threading.Thread | None = None
        if config.rescan_interval_s > 0:
            self._rescanner = start_thread(self._rescan_loop, "kv_file-rescan")
        self._watch = Watch(self._catalog, self._failures)
        self._hand_over = HandOver(self._counters)
        log.info(
            "kv_file store at %s: %d objects, %d of %d bytes, fsync=%s",
            self._dir.path,
            len(self._index),
            self._index.files_bytes,
            config.capacity_bytes,
            config.fsync,
        )

    # -- hooks -----------------------------------------------------------------------------

    @kvcore.hookimpl
    def kvcore_query(self, request: BlockRequest) -> int:
        self._settle()
        self._catalog.sync()  # what other processes stored, removed or evicted meanwhile
        return self._stored_run(request, 0, name_columns(request.object_names, len(request.parts)))

    @kvcore.hookimpl
    def kvcore_contains(self, request: BlockRequest) -> list[bool]:
        """Every block's presence in one pass over the index (one catalog sync, however many
        gaps): a leading run from each gap on."""
        self._settle()
        self._catalog.sync()
        total = request.num_blocks
        columns = name_columns(request.object_names, len(request.parts))  # once, not per gap
        found: list[bool] = []
        while len(found) < total:
            end = self._stored_run(request, len(found), columns)
            found.extend([True] * (end - len(found)))
            if len(found) < total:
                found.append(False)
                if request.expired():  # what is left stays unknown: not found
                    found.extend([False] * (total - len(found)))
        return found

    def _stored_run(self, request: BlockRequest, start: int, columns: list[list[str]]) -> int:
        """Where the run of stored blocks from block ``start`` ends (an absolute index);
        ``columns``: the request's names by part (``name_columns``)."""
        known = self._index.by_name.__contains__  # without the lock: a dict probe is atomic
        names = request.object_names
        total = request.num_blocks
        for lo in range(start, total, _QUERY_DEADLINE_STRIDE):
            hi = min(total, lo + _QUERY_DEADLINE_STRIDE)
            # a stride's names probed by map() in C: a Python loop per name cost most of a
            # 10,000-block query
            if not all(all(map(known, column[lo:hi])) for column in columns):
                first = next(i for i in range(lo, hi) if not all(map(known, names[i])))
                return self._files.learn(request, first)  # looked for on disk
            if hi < total and request.expired():
                return hi
        return total

    @kvcore.hookimpl
    def kvcore_describe(self, request: BlockRequest) -> list[bytes | None]:
        """Each block's metadata from its first part's header (one page read, no payload)."""
        out: list[bytes | None] = []
        for i, names in enumerate(request.object_names):
            if i % _QUERY_DEADLINE_STRIDE == 0 and i and request.expired():
                out.extend([None] * (request.num_blocks - i))
                break
            raw = encode_name(names[0])
            out.append(read_meta(self._dir.object_path(self._digest(names[0], raw)), raw))
        return out

    @kvcore.hookimpl
    def kvcore_names(self) -> list[str]:
        """Every named object of the directory, as the index holds it (all namespaces)."""
        self._catalog.sync()
        with self._index.lock:
            return list(self._index.by_name)

    @kvcore.hookimpl
    def kvcore_admit(self, request: BlockRequest) -> int:
        """The store's admission policy (``admission``) on the blocks offered."""
        self._catalog.sync()
        return self._admission.admit(request)

    @kvcore.hookimpl
    def kvcore_read(self, request: BlockRequest) -> int:
        self._settle()
        host = request.host
        assert host is not None  # the core sends host buffers to io="host" backends
        index = self._index
        hits: list[tuple[int, int]] = []  # (k, digest)
        adopted: list[tuple[int, int, bytes | None]] = []
        gone: list[int] = []

        def read_one(k: int) -> str:
            i, j, name, raw, digest = self._locate(request, k)
            expected = self._payload_bytes(request.parts[j])
            outcome = read_object(
                self._dir.object_path(digest),
                raw,
                host.views(i, j),
                digest=digest,
                expected_len=expected,
                direct=self._direct,
            )
            if outcome is ReadOutcome.OK:
                if not index.learn(name, digest):  # a file no record told of: adopt it
                    named = raw if expected in (None, host.nbytes[j]) else None
                    adopted.append((digest, header_size(len(raw)) + host.nbytes[j], named))
                hits.append((k, digest))
            elif outcome is ReadOutcome.MISNAMED:
                index.unname(name)
            elif outcome is not ReadOutcome.WRONG_SIZE:  # the file is gone or was removed
                gone.append(digest)
            return READ_COUNTERS[outcome]

        workers = self._read_workers(request)
        try:
            outcomes, errors = self._batches.run(
                request, read_one, host.nbytes, workers, "io_errors"
            )
        finally:  # what the read learned, for every process: after the data, off its path
            # most recently used in the request's order, whichever thread read what first
            hits.sort()
            now = time.time_ns()
            for _, digest in hits:
                index.touch(digest, now)
            self._catalog.adopted(adopted)
            self._catalog.gone(gone)
            self._catalog.read([digest for _, digest in hits])
            nparts = len(request.parts)
            self._admission.read(request, [k // nparts for k, _ in hits if k % nparts == 0])
        return answer(outcomes, errors, len(request.parts))

    @kvcore.hookimpl
    def kvcore_write(self, request: BlockRequest) -> int:
        """Objects already on disk are skipped (and pinned, so this write cannot evict what
        it acknowledges); the others' bytes are reserved in order, as one run: when the batch
        does not fit, the leading run that fits is stored and acknowledged, the rest refused.
        """
        self._settle()
        host = request.host
        assert host is not None  # the core sends host buffers to io="host" backends
        index = self._index
        catalog = self._catalog
        planned: dict[int, tuple[bytes, int, int, bytes | None]] = {}
        before: list[str | None] = [None] * (request.num_blocks * len(request.parts))
        pinned: list[int] = []  # acknowledged objects: evictions pass them over until we return
        written_dirs: dict[str, list[int]] = {}
        for k in range(len(before)):
            if k % len(request.parts) == 0 and request.expired():
                before[k] = "deadline"
                break
            _, j, _, raw, digest = self._locate(request, k)
            size = header_size(len(raw)) + host.nbytes[j]
            # named only as an object of its part's size (the core checks buffers against the
            # layout; this keeps any other object from ever being counted by its name)
            named = raw if self._payload_bytes(request.parts[j]) in (None, host.nbytes[j]) else None
            if self._files.hold_stored(digest, named, size):
                pinned.append(digest)
                before[k] = "write_skipped"  # names are content-derived: same name, same bytes
            else:
                planned[k] = (raw, digest, size, named)
        order = list(planned)
        # skipped objects are being stored again: most recently used, for every process
        admitted = catalog.admit(
            [planned[k][2] for k in order], touched=pinned, deadline=request.deadline
        )
        for k in order[admitted:]:
            before[k] = "write_refused"
            del planned[k]
        reserved = dict(planned)  # reservations not yet turned into files or given back
        written: list[tuple[int, int, int, bytes | None]] = []  # k, digest, size, name

        def write_one(k: int) -> str:
            if k not in planned:
                return before[k] or "deadline"
            raw, digest, size, named = planned[k]
            i, j = divmod(k, len(request.parts))
            del reserved[k]
            try:
                write_object(
                    self._dir.object_path(digest),
                    self._dir.temp_path(digest),
                    raw,
                    host.views(i, j),
                    sync=self._sync,
                    meta=None if request.block_meta is None else request.block_meta[i],
                )
            except OSError:
                catalog.release(size)
                raise
            written.append((k, digest, size, named))  # recorded with the rest, in one go
            if self._sync_dirs:
                written_dirs.setdefault(self._dir.subdir(digest), []).append(k)
            return "write_stored"

        # Synced writes wait on the disk; unsynced ones are copies into the page cache.
        workers = self.config.io_threads if self._sync else min(self.config.io_threads, self._cpus)
        try:
            try:
                outcomes, errors = self._batches.run(
                    request, write_one, host.nbytes, workers, "write_errors"
                )
            finally:  # every file in place becomes a file of the store, also on a failure
                # recorded in the request's order (the LRU order then does not depend on
                # which thread finished first)
                written.sort(key=lambda w: w[0])
                lost = catalog.stored([(d, size, name) for _, d, size, name in written])
            for k, digest, _, _ in written:
                if digest in lost:
                    outcomes[k] = "write_refused"  # evicted by another process meanwhile
                else:
                    pinned.append(digest)
            for d, ks in written_dirs.items():  # one directory fsync per batch, not per object
                try:
                    fsync_dir(d)
                except OSError as exc:
                    for k in ks:
                        outcomes[k], errors[k] = "write_errors", exc
        finally:
            unused = sum(size for _, _, size, _ in reserved.values())  # stopped before written
            if unused:
                catalog.release(unused)
            index.unpin(pinned)
        return answer(outcomes, errors, len(request.parts))

    @kvcore.hookimpl
    def kvcore_remove(self, request: BlockRequest) -> int:
        """Unlink this rank's objects of the request's blocks. Durable as the rename of a
        write is (with ``fsync=data_and_dir``, the directories are synced); processes sharing
        the directory see it at their next query (see :mod:`kv_file.journal`)."""
        self._catalog.sync()
        return remove_blocks(self._files, request.object_names, self._digest)

    @kvcore.hookimpl
    def kvcore_clear(self) -> int:
        """Unlink every object of this engine's namespace in the directory, of every rank: all
        of them in the namespace's own directory, else those whose header names the namespace
        (a configured ``namespace`` directory may be shared with other engines)."""
        return clear_objects(self._files, self._name_prefix, self._own_directory)

    @kvcore.hookimpl
    def kvcore_stats(self) -> dict[str, float]:
        self._settle()
        index = self._index
        out = self._counters.snapshot()
        out.update(
            objects=float(len(index)),
            bytes_used=float(self._catalog.used()),
            capacity_bytes=float(index.capacity),
            evictions=float(self._catalog.evictions),
            journal_bytes=float(self._catalog.journal.size),
            own_files_bytes=float(self._catalog.own_bytes()),
            directory_bytes=float(self._catalog.directory_bytes),
        )
        out["direct_reads"] = float(self._direct.count)
        out.update(self._admission.stats())
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
        gb = nbytes / 1e9  # GB/s are 10^9 bytes per second in every kvcore figure
        return {"write_gbps": gb / (t1 - t0), "read_gbps": gb / (t2 - t1)}

    @kvcore.hookimpl
    def kvcore_evict_to(self, sink: EvictionSink | None) -> bool:
        """Objects a write evicts are read back from their files, verified, and offered to
        ``sink`` by that write, before they leave; only those the sink took are evicted (see
        :meth:`Catalog._admit_handing_over`)."""
        self._hand_over.sink = None if sink is None else sink_caller(sink)
        self._catalog.hand_over = None if sink is None else self._hand_over
        self._settle()  # with the sink attached: what opening leaves to evict is handed over
        return True

    @kvcore.hookimpl
    def kvcore_watch(self, report: Callable[..., None] | None) -> set[str] | None:
        """Report every change of the directory, whoever makes it, in the journal's order
        (see :mod:`kv_file.catalog`): a router following any one process sees the store."""
        return self._watch.watch(report)

    @kvcore.hookimpl
    def kvcore_close(self) -> None:
        self._stop.set()
        self._watch.close()
        if self._rescanner is not None:
            self._rescanner.join()
        self._batches.shutdown()
        self.save_recency()
        self._catalog.close()

    # -- what a restart rebuilds from ------------------------------------------------------

    def save_recency(self) -> int:
        """Write the times of recent read hits to the files' mtimes, which a restart orders by.

        Done in batches (every rescan interval and at close) rather than per read: a ``utime``
        per object cost ~6% of warm read throughput. A crash loses at most one interval of
        recency, which only makes eviction after the restart slightly less exact.
        """
        return self._files.save_recency()

    # -- cross-process visibility ----------------------------------------------------------

    def rescan(self) -> None:
        """A full scan: adopt files no record told of, forget files that are gone, free the
        reservations of processes that died (see :meth:`Catalog.reconcile`)."""
        self._catalog.reconcile()
        self._catalog.admit([0])  # adopted files may pass the capacity: evict down to it

    def _rescan_loop(self) -> None:
        while not self._stop.wait(self.config.rescan_interval_s):
            try:
                self.save_recency()
                # every process applies every record: one of them scanning is enough
                if self._catalog.scan_due(self.config.rescan_interval_s):
                    self.rescan()
            except Exception as exc:  # keep scanning later; a failed scan only delays adoption
                log.warning("kv_file rescan of %s failed: %r", self._dir.path, exc)

    # -- plumbing --------------------------------------------------------------------------

    def _settle(self) -> None:
        """Once, at the first call after opening: evict down to the capacity (see
        ``__init__``); later calls cost one attribute read."""
        if self._unsettled:
            self._unsettled = False
            self._catalog.admit([0])

    def _locate(self, request: BlockRequest, k: int) -> tuple[int, int, str, bytes, int]:
        """Object ``k`` of a request (flat ``[block][part]`` order): its block and part
        index, name, encoded name and file digest."""
        i, j = divmod(k, len(request.parts))
        name = request.object_names[i][j]
        raw = encode_name(name)
        return i, j, name, raw, self._digest(name, raw)

    def _payload_bytes(self, part: str) -> int | None:
        """Bytes an object of ``part`` holds by the layout (None: no layout, or no such part)."""
        return None if self._payload is None else self._payload.get(part)

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
