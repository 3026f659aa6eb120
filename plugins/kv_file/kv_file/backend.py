"""The ``file`` backend: kvcore's embedded default store, one file per object under a root.

A request's objects move as one batch on a small thread pool (the calling thread works too;
:mod:`kv_file.transfer`): each object is one ``open``/``preadv``/``close`` straight into the
caller's memory on reads (``O_DIRECT`` when the page cache does not hold it, see
:class:`~kv_file.objio.DirectReads`), and one ``writev`` of header and payload to a temp file
plus a ``rename`` on writes, in native code with no GIL (:mod:`kv_file.objbatch`). The
caller's memory is a staging region per object, or the engine's own host-resident cache
blocks, one piece per layer (segmented host buffers): the vectored calls take either as it is.

The index is a cache of what is on disk, never trusted alone where it is cheap to check: a
write skips an object only after an ``lstat`` shows a regular file of the right size; a query
counts a name only for a file of the size the layout gives it; a read verifies everything and
removes what is not the object its name promises (a torn or damaged file, an object of another
size or at another object's place, a symlink, a directory, a FIFO), so a rewrite lands."""

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
from kv_file.batch import Batches
from kv_file.catalog import Catalog
from kv_file.config import FileConfig, safe_namespace
from kv_file.files import ObjectFiles, describe, retire_files
from kv_file.handover import HandOver
from kv_file.model import StoreModel
from kv_file.objfile import encode_name
from kv_file.objio import DirectReads, read_meta
from kv_file.paths import StoreDir
from kv_file.removal import clear_objects, clear_tenant, remove_blocks
from kv_file.transfer import Transfers
from kv_file.watch import Watch
from kvcore import BlockRequest, FailureKind, Outcome
from kvcore.evictions import EvictionSink, sink_caller
from kvcore.keys import name_columns
from kvcore.tenants import DEFAULT_TENANT, UNKNOWN_TENANT, tenant_gauges
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
        lookup_reads=True,  # (the role changes nothing: any process reads the files)
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
        self._direct = DirectReads(config.direct_reads, self._dir.path)
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
            tenants=config.tenants,
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
        self._transfers = Transfers(
            self._dir,
            self._catalog,
            self._files,
            self._admission,
            self._batches,
            self._direct,
            self._payload,
            sync=self._sync,
            sync_dirs=self._sync_dirs,
            io_threads=config.io_threads,
            cpus=self._cpus,
            default_tenant=DEFAULT_TENANT
            if config.tenants is None
            else config.tenants.default_tenant,
        )
        self._resume_clears()  # a tenant's deletion a crash cut short: finished before serving
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
                # looked for on disk
                return self._withheld_from(request, start, self._files.learn(request, first))
            if hi < total and request.expired():
                return hi
        return self._withheld_from(request, start, total)

    def _withheld_from(self, request: BlockRequest, start: int, end: int) -> int:
        """``end``, or the first block from ``start`` of a tenant being deleted (its objects
        are no longer found)."""
        index = self._index
        if not index.clearing:
            return end
        names = request.object_names[start:end]
        by_name = index.by_name
        digests = [by_name.get(n, -1) for block in names for n in block]
        cut = index.withheld(digests)
        return end if cut is None else start + cut // len(request.parts)

    @kvcore.hookimpl
    def kvcore_describe(self, request: BlockRequest) -> list[bytes | None]:
        """Each block's metadata from its first part's header (one page read, no payload)."""
        out: list[bytes | None] = []
        for i, names in enumerate(request.object_names):
            if i % _QUERY_DEADLINE_STRIDE == 0 and i and request.expired():
                out.extend([None] * (request.num_blocks - i))
                break
            raw = encode_name(names[0])
            out.append(read_meta(self._dir.object_path(self._transfers.digest(names[0], raw)), raw))
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
        """See :meth:`kv_file.transfer.Transfers.read`."""
        self._settle()
        return self._transfers.read(request)

    @kvcore.hookimpl
    def kvcore_write(self, request: BlockRequest) -> int:
        """See :meth:`kv_file.transfer.Transfers.write`."""
        self._settle()
        return self._transfers.write(request)

    @kvcore.hookimpl
    def kvcore_remove(self, request: BlockRequest) -> int:
        """Unlink this rank's objects of the request's blocks. Durable as the rename of a
        write is (with ``fsync=data_and_dir``, the directories are synced); processes sharing
        the directory see it at their next query (see :mod:`kv_file.journal`)."""
        self._catalog.sync()
        return remove_blocks(self._files, request.object_names, self._transfers.digest)

    @kvcore.hookimpl
    def kvcore_clear(self) -> int:
        """Unlink every object of this engine's namespace in the directory, of every rank: all
        of them in the namespace's own directory, else those whose header names the namespace
        (a configured ``namespace`` directory may be shared with other engines)."""
        return clear_objects(self._files, self._name_prefix, self._own_directory)

    @kvcore.hookimpl
    def kvcore_clear_tenant(self, tenant: str) -> int:
        """Unlink every object of ``tenant`` in the directory, of every namespace and every
        process sharing it, crash-safe (see :func:`kv_file.removal.clear_tenant`)."""
        self._catalog.sync()
        tenants = self.config.tenants
        named = tenants is not None and tenant in (*tenants.tenants, tenants.default_tenant)
        if not named and tenant != DEFAULT_TENANT and not self._index.holds(tenant):
            return Outcome(
                0,
                f"{UNKNOWN_TENANT} {tenant!r}: the store's settings do not name it and it "
                "holds no object",
                FailureKind.UNKNOWN_TENANT,
            )
        return clear_tenant(self._files, tenant)

    def _resume_clears(self) -> None:
        """Finish the deletions of tenants the journal says were started and not finished by
        a store that is no longer open (its process died, or a removal failed and it closed):
        one still clearing finishes its own."""
        for tenant in self._catalog.orphaned_clears():
            log.warning("kv_file: finishing the deletion of tenant %r left unfinished", tenant)
            clear_tenant(self._files, tenant)

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
            own_files_bytes_per_object=self._catalog.own_bytes_per_object(),
            own_files_bytes_base=float(self._catalog.own_bytes_base()),
            directory_bytes=float(self._catalog.directory_bytes),
        )
        out["direct_reads"] = float(self._direct.count)
        out.update(self._admission.stats())
        out.update(self._tenant_stats())
        return out

    def _tenant_stats(self) -> dict[str, float]:
        """Bytes each tenant holds (of every process), and, with shares, each one's reserved
        share and quota and the bytes this process evicted of it."""
        index, tenants = self._index, self.config.tenants
        with index.lock:
            held = dict(index.tenant_bytes)
        if tenants is not None:
            for tenant in [*tenants.tenants, tenants.default_tenant]:
                held.setdefault(tenant, 0)
        out = tenant_gauges("bytes_held", held)
        evicted = dict(self._catalog.evicted_by)
        if evicted:
            out.update(tenant_gauges("bytes_evicted", evicted))
        if tenants is not None and tenants.tenants:
            shares = tenants.tenants.items()
            out.update(tenant_gauges("bytes_reserved", {t: s.reserved_bytes for t, s in shares}))
            quotas = {t: s.quota_bytes for t, s in shares if s.quota_bytes is not None}
            if quotas:
                out.update(tenant_gauges("bytes_quota", quotas))
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
        self._resume_clears()

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
