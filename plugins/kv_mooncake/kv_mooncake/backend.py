"""The ``mooncake`` kvcore backend: blocks as objects in a Mooncake Store cluster.

- Query: one ``batch_is_exist`` over every object of the request (K, V and scales).
- Write: the same existence check first. It lets the write skip objects already stored
  (names are content-derived, and Mooncake keeps the old value on a repeated put anyway), and
  it fails at once when the master is down, where a put would stall for seconds. Then
  ``batch_upsert_from`` for the rest: not ``batch_put_from``, which answers 0 yet stores
  nothing for a name whose put another writer started and never finished (killed while the
  master was stalled: the master keeps that put until ``put_start_discard_timeout_sec``,
  30 s by default, and meanwhile no put of the name lands). The existence check skipped every
  name stored whole, so an upsert only ever replaces such an unfinished put, with the same
  bytes (same name, same bytes). A put that meets another live writer's put of the same name
  (Mooncake answers one of two concurrent puts of a key with -601) waits for it within the
  deadline and counts once the master holds the name whole (``puts_racing_another_writer``):
  two engines, or a stack's background copy and its eviction hand-down, writing one block both
  get it acknowledged. Within one client, a name is put by one thread at a time: two
  overlapping puts of one name by the same client publish unwritten buffers
  (:mod:`kv_mooncake.inflight`), so a thread leaves a name another is putting to it and
  waits for it the same way.
- Read: ``batch_get_into``; its per-object answers (bytes read, or -704) give the leading run.
- Segmented host buffers (an object in pieces, one per layer, in the engine's own cache
  blocks): ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``, one piece
  list per object (the client has no upsert from pieces: what the put answered as stored is
  confirmed with ``batch_is_exist``, and an unfinished put of another writer is waited for,
  within the request's deadline). The engine's cache is registered once through ``kvcore_register_buffer``.
  An object of another size than the layout gives its part is removed, so a rewrite lands
  (a put of an existing key keeps the old value).
- Remove: ``batch_remove`` of the request's keys; clear: ``remove_by_regex`` of the namespace's
  key prefix (the client cannot list keys). Both skip Mooncake's read leases unless
  ``force_remove`` is off (see the README).
- Block metadata (what a block says of itself: an engine's block hash, parent, tokens): a
  small companion object beside the block's first object (and every object whose key is a
  digest of its name), verified and named
  (:mod:`kv_mooncake.block_meta`), written before the object, removed with it; ``describe``
  checks the object is there and reads its companion.
- Listing and following the store (with ``master_metrics_port``): the master's key listing
  names what the store holds (:mod:`kv_mooncake.listing`), and while the backend's events are
  followed, other clients' stores and removals and the master's evictions are found by
  listing it every ``watch_interval_s`` (:mod:`kv_mooncake.watch`): the stream then describes
  the whole store. Without the port, the stream reports what this client did and the
  evictions its own lookups find (:mod:`kv_mooncake.observed`).
- A negative code other than "not found" is a failure: the hook's answer is then
  ``Outcome(n, failure=...)``, and the engine sees a backend error rather than a miss.

Deadlines: a master RPC ends after ``MC_RPC_TIMEOUT_MS`` at the latest, so a call made with
more time left than that cannot overrun. With less time left, the existence check (also done
before a read then) runs on a helper thread and is abandoned at the deadline; it touches no
caller memory. Data calls are never abandoned, since Mooncake would go on reading or writing
the caller's buffers after we returned; they run in chunks of ``max_batch_bytes`` with the
deadline checked between chunks.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import kvcore
from kv_mooncake import block_meta
from kv_mooncake.background import PUT_THREADS, READ_THREADS, BackgroundCalls
from kv_mooncake.codes import (
    ALREADY_EXISTS,
    HAS_LEASE,
    INVALID_PARAMS,
    INVALID_WRITE,
    NOT_FOUND,
    REPLICA_NOT_READY,
    TRANSFER_FAILED,
    failure,
    reason,
)
from kv_mooncake.companions import COMPANIONS_PER_CALL, CompanionReader
from kv_mooncake.config import MooncakeConfig
from kv_mooncake.connect import open_store, prepare_environment
from kv_mooncake.inflight import NamesBeingWritten, PieceBudget, queued_transfers_limit
from kv_mooncake.listing import StoreListing
from kv_mooncake.observed import ObservedDrops
from kv_mooncake.regions import RegionTable
from kv_mooncake.store_keys import namespace_pattern, store_key, store_key_as_is
from kv_mooncake.watch import StoreWatch
from kvcore import BlockRequest, FailureKind, Outcome, leading_run
from kvcore.requests import merge_spans
from kvcore.threads import start_thread, thread_pool

__all__ = ["MooncakeBackend"]

log = logging.getLogger("kvcore.mooncake")

#: Threads that run existence checks for requests with short deadlines.
PROBE_WORKERS = 4
#: First and longest sleep while waiting for another writer's put to complete.
_READY_POLL_S = 0.001
_READY_POLL_MAX_S = 0.05
#: An inline call is safe when the deadline is further away than this many RPC timeouts.
_INLINE_FACTOR = 1.5
#: Buffer pieces per data call at most: one per key for batch_put_from / batch_get_into, one
#: per segment for the multi-buffer calls. Mooncake 0.3.13's client fails the pieces of one call
#: beyond 2048 with -800 (TRANSFER_FAIL) or -704, and after some such calls fails every later
#: put too (measured: 2049 keys fine, 2100 all but 5 failed and broke the client; 256 keys of
#: 8 segments fine, 257 lost one key, 300 lost them all).
MAX_BATCH_PIECES = 1024


class MooncakeBackend:
    """kvcore backend over ``mooncake.store.MooncakeDistributedStore`` (one client per rank)."""

    config_model = MooncakeConfig
    # not persistent; segmented host buffers (a host-resident engine cache) go through the
    # multi-buffer calls, straight into and out of the cache's blocks
    # lookup_reads: a client that mounts no segment still reads the others' into memory
    # registered with it
    capabilities = kvcore.Capabilities(
        addressing="key",
        io="host",
        shared=True,
        segmented_host=True,
        block_meta=True,
        lookup_reads=True,
    )

    def __init__(self, config: MooncakeConfig, context: kvcore.BackendContext) -> None:
        self.config = config
        self.context = context
        layout = context.layout
        #: payload bytes of each part by the layout (None: no layout): an object of another
        #: size under a part's name is not that object
        self._payload = {p: layout.part_bytes(p) for p in layout.parts} if layout else None
        rpc_timeout_s = prepare_environment(config, context.device_id)
        self._inline_after_s = rpc_timeout_s * _INLINE_FACTOR + 0.1
        # calls of concurrent tasks share the transport's queue: never overfill it
        self._pieces = PieceBudget(queued_transfers_limit())
        #: names this client is putting (one client must never put a name twice at once)
        self._writing = NamesBeingWritten()
        self._max_call_pieces = min(MAX_BATCH_PIECES, self._pieces.limit)
        self._store: Any = open_store(
            config, context.device_id, lookups_only=context.role == "lookup"
        )
        from mooncake.store import ReplicateConfig  # importable once open_store succeeded

        self._replicate = ReplicateConfig()
        self._replicate.replica_num = config.replica_num
        self._regions = RegionTable(self._store.register_buffer, self._store.unregister_buffer)
        self._counters = kvcore.Counters()
        self._warnings = kvcore.OnceLogger(log)
        self._probes = thread_pool(PROBE_WORKERS, "kv-mooncake-probe")
        #: every put is made from here, and every read a caller waits for idle: the client
        #: polls a transfer until it ends (kv_mooncake.background)
        self._puts = BackgroundCalls(PUT_THREADS, "kv-mooncake-put")
        self._idle_reads = BackgroundCalls(READ_THREADS, "kv-mooncake-read")
        #: what this client stored, to report an eviction when it finds one gone
        self._drops = ObservedDrops(frozenset((0, NOT_FOUND)))  # batch_is_exist: 0 absent
        listing_url = config.master_url("/get_all_keys")
        self._listing = (
            None
            if listing_url is None
            else StoreListing(
                listing_url,
                context.namespace,
                config.key_scheme == "namespaced",
                config.connect_timeout_s,
                self._read_companions,
                self._key,
            )
        )
        #: the whole store's changes, when it can be listed
        self._watch = (
            None
            if self._listing is None
            else StoreWatch(self._listing, config.watch_interval_s, self._counters, self._warnings)
        )
        self._stuck = 0  # abandoned checks still running: when all workers are, skip the master
        self._stuck_lock = threading.Lock()

    # -- hooks -----------------------------------------------------------------------------

    @kvcore.hookimpl
    def kvcore_query(self, request: BlockRequest) -> int:
        if request.num_blocks == 0:
            return 0
        codes = self._master_call(self._store.batch_is_exist, self._keys(request), request)
        if not isinstance(codes, list):
            return codes
        self._drops.looked(_names(request), codes)
        return self._present_run(codes, len(request.parts))

    @kvcore.hookimpl
    def kvcore_contains(self, request: BlockRequest) -> list[bool]:
        """Every block's presence from one ``batch_is_exist`` (one master round trip, however
        many gaps the blocks have)."""
        if request.num_blocks == 0:
            return []
        codes = self._master_call(self._store.batch_is_exist, self._keys(request), request)
        if not isinstance(codes, list):  # no answer: kvcore counts the failure
            raise ConnectionError(codes.failure or "no answer from the mooncake master")
        self._drops.looked(_names(request), codes)
        parts = len(request.parts)
        return [
            all(code == 1 for code in codes[i * parts : (i + 1) * parts])
            for i in range(request.num_blocks)
        ]

    @kvcore.hookimpl
    def kvcore_read(self, request: BlockRequest) -> int:
        if request.num_blocks == 0:
            return 0
        parts, keys, objects = self._objects(request)
        present: int = request.num_blocks
        if request.time_left() <= self._inline_after_s:
            # a hung master could hold the get past the deadline: ask first, abandonably
            codes = self._master_call(self._store.batch_is_exist, keys, request)
            if not isinstance(codes, list):
                return codes
            present = self._present_run(codes, parts)
            if present == 0:
                return present
        # otherwise the get's own per-object answers (-704 for a miss) end the run
        m = present * parts
        ok, code = self._transfer("read", keys[:m], objects.slice(0, m), request)
        n = leading_run(ok, parts)
        if code is None and n == present:
            return present  # with the existence check's failure, if one ended the run
        return _answer(n, code, objects.call("batch_get_into"))

    @kvcore.hookimpl
    def kvcore_write(self, request: BlockRequest) -> int:
        if request.num_blocks == 0:
            return 0
        parts, keys, objects = self._objects(request)
        codes = self._master_call(self._store.batch_is_exist, keys, request)
        if not isinstance(codes, list):
            return codes
        names = _names(request)
        self._drops.looked(names, codes)
        if any(c < 0 for c in codes):
            # the master answered with errors: a put now would only stall, so stop here
            return self._present_run(codes, parts)
        stored = [c == 1 for c in codes]
        todo = [i for i, present in enumerate(stored) if not present]
        self._counters.add("objects_skipped", len(keys) - len(todo))
        code = None
        with self._changing(names):
            if todo:
                if request.block_meta is not None:
                    self._write_companions(request, names, keys, todo)
                todo_keys = [keys[i] for i in todo]
                ok, code = self._transfer("write", todo_keys, objects.pick(todo), request)
                for i, good in zip(todo, ok, strict=True):
                    stored[i] = good
            done = leading_run(stored, parts)
            self._drops.stored(names[: done * parts])
            if self._watch is not None and self._watch.active:
                landed = [i for i, good in enumerate(stored) if good]
                self._watch.stored([names[i] for i in landed], [objects.sizes[i] for i in landed])
        return _answer(done, code, objects.call("batch_put_from"))

    def _changing(self, names: Sequence[str]) -> contextlib.AbstractContextManager[None]:
        """While this client changes ``names`` (see :meth:`StoreWatch.changing`)."""
        if self._watch is None or not self._watch.active:
            return contextlib.nullcontext()
        return self._watch.changing(names)

    @kvcore.hookimpl
    def kvcore_remove(self, request: BlockRequest) -> int:
        """``batch_remove`` of this rank's objects of the request's blocks. With
        ``force_remove`` (default) leases are skipped; otherwise objects read in the last
        lease period stay, and the answer reports them as a failure."""
        if request.num_blocks == 0:
            return 0
        parts = len(request.parts)
        keys = self._keys(request)
        names = _names(request)
        with self._changing(names):
            codes = self._master_call(
                lambda ks: self._store.batch_remove(ks, self.config.force_remove), keys, request
            )
            if not isinstance(codes, list):
                return codes
            self._drops.forgotten(names)
            self._remove_companions(keys, parts)
            if self._watch is not None and self._watch.active:
                self._watch.removed(
                    [n for n, c in zip(names, codes, strict=True) if c in (0, NOT_FOUND)]
                )
        removed = sum(
            any(c == 0 for c in codes[i * parts : (i + 1) * parts])
            for i in range(request.num_blocks)
        )
        self._counters.add("objects_removed", sum(c == 0 for c in codes))
        bad = next((c for c in codes if c not in (0, NOT_FOUND)), None)
        if bad is None:
            return removed
        self._counters.add(f"remove_{reason(bad)}", sum(c == bad for c in codes))
        why = failure("batch_remove", bad)
        if bad == HAS_LEASE:
            why += ": read in the last lease period; retry later, or set force_remove"
        return Outcome(removed, why)

    @kvcore.hookimpl
    def kvcore_clear(self) -> int:
        """``remove_by_regex`` of every key under this namespace's prefix (all ranks; see
        :mod:`kv_mooncake.store_keys`). Without ``force_remove``, leased objects stay and
        cannot be counted: the client cannot list keys."""
        if self.config.key_scheme == "as_is":
            return Outcome(0, "key_scheme 'as_is' stores names as they are: no namespace prefix")
        removed = self._store.remove_by_regex(
            namespace_pattern(self.context.namespace), self.config.force_remove
        )
        self._drops.forgotten()
        if self._watch is not None:
            self._watch.cleared()
        if removed < 0:
            self._counters.add(f"clear_{reason(removed)}")
            return Outcome(0, failure("remove_by_regex", removed))
        self._counters.add("objects_removed", removed)
        return removed

    @kvcore.hookimpl
    def kvcore_watch(self, report: Any) -> set[str] | None:
        """With a listable store, every change of the namespace, whoever made it (see
        :mod:`kv_mooncake.watch`). Otherwise evictions as this client can see them (see
        :mod:`kv_mooncake.observed`): an object this client stored is reported evicted when a
        lookup of its own finds it gone."""
        if self._watch is not None:
            return self._watch.watch(report)
        self._drops.watch(report)
        return None  # kvcore publishes stores, removals and clears; evictions come from here

    @kvcore.hookimpl
    def kvcore_describe(self, request: BlockRequest) -> list[bytes | None]:
        """Each block's metadata from its first object's companion, for blocks whose first
        object is stored; a companion that does not verify, or names another object, is
        none (counted: ``block_meta_unverified``)."""
        if request.num_blocks == 0:
            return []
        names = [row[0] for row in request.object_names]
        keys = [self._key(name) for name in names]
        codes = self._store.batch_is_exist(keys)
        if any(c < 0 and c != NOT_FOUND for c in codes):
            raise ConnectionError(failure("batch_is_exist", min(codes)))
        present = [i for i, c in enumerate(codes) if c == 1]
        out: list[bytes | None] = [None] * len(names)
        blobs = self._read_companions([block_meta.meta_key(keys[i]) for i in present])
        for i, blob in zip(present, blobs, strict=True):
            if not blob:
                continue  # written without metadata
            decoded = block_meta.decode(blob)
            if decoded is None or decoded[0] != names[i]:
                self._counters.add("block_meta_unverified")
                continue
            out[i] = decoded[1]
        return out

    @kvcore.hookimpl
    def kvcore_names(self) -> list[str]:
        """The master's key listing (:mod:`kv_mooncake.listing`)."""
        if self._listing is None:
            raise RuntimeError(
                "listing a Mooncake store needs the master's HTTP port: set master_metrics_port"
            )
        return list(self._listing.names().values())

    @kvcore.hookimpl
    def kvcore_register_buffer(self, ptr: int, nbytes: int) -> None:
        code = self._regions.add(ptr, nbytes)
        if code != 0:
            # not fatal: requests in this region fall back to temporary registration
            self._counters.add("register_failed")
            self._warnings.warning(
                ("register", code),
                "mooncake: registering %d bytes at %#x failed with code %d (%s); further "
                "failures with this code are logged at debug level",
                nbytes,
                ptr,
                code,
                reason(code),
            )

    @kvcore.hookimpl
    def kvcore_unregister_buffer(self, ptr: int) -> None:
        if self._regions.remove(ptr) != 0:
            log.debug("mooncake: no registered region starts at %#x", ptr)

    @kvcore.hookimpl
    def kvcore_stats(self) -> dict[str, float]:
        stats = self._counters.snapshot()
        stats["registered_regions"] = float(self._regions.count)
        return stats

    @kvcore.hookimpl
    def kvcore_raw_baseline(self, ptr: int, nbytes: int, object_nbytes: int) -> dict[str, float]:
        """The raw client on the same bytes: one batch_put_from and one batch_get_into."""
        n = max(1, nbytes // object_nbytes)
        tag = uuid.uuid4().hex
        keys = [f"kvcore-raw-baseline-{tag}-{i}" for i in range(n)]
        ptrs = [ptr + i * object_nbytes for i in range(n)]
        sizes = [object_nbytes] * n
        regions = self._regions
        pinned, _ = regions.pin([(ptr, ptr + n * object_nbytes)])
        try:
            t0 = time.perf_counter()
            put = self._store.batch_put_from(keys, ptrs, sizes)
            t1 = time.perf_counter()
            got = self._store.batch_get_into(keys, ptrs, sizes)
            t2 = time.perf_counter()
        finally:
            regions.unpin(pinned)
            self._store.batch_remove(keys, True)  # leave nothing behind in the cluster
        gb = n * object_nbytes / 1e9  # GB/s are 10^9 bytes per second in every kvcore figure
        out: dict[str, float] = {}
        if all(c == 0 for c in put):
            out["write_gbps"] = gb / (t1 - t0)
        if all(c == object_nbytes for c in got):
            out["read_gbps"] = gb / (t2 - t1)
        return out

    @kvcore.hookimpl
    def kvcore_close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        store, self._store = self._store, None
        if store is None:
            return
        self._regions.clear()
        # the region table holds the client's bound methods: drop them, so the client (its
        # segments, buffers and threads) is freed once its close returns, not whenever the
        # cyclic garbage collector next runs (16 opens and closes kept 250 MB before)
        self._regions = RegionTable(_closed_register, _closed_unregister)
        _close_store(
            store, self._probes, (self._puts, self._idle_reads), self.config.close_timeout_s
        )

    # -- Mooncake calls ----------------------------------------------------------------------

    @property
    def store(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (for benchmarks and diagnostics)."""
        return self._store

    def _keys(self, request: BlockRequest) -> list[str]:
        """The Mooncake keys of the request's objects, flat in ``[block][part]`` order."""
        if self.config.key_scheme == "as_is":
            return [store_key_as_is(n) for names in request.object_names for n in names]
        namespace = self.context.namespace
        return [store_key(name, namespace) for names in request.object_names for name in names]

    def _key(self, name: str) -> str:
        """The Mooncake key of object ``name``."""
        if self.config.key_scheme == "as_is":
            return store_key_as_is(name)
        return store_key(name, self.context.namespace)

    def _write_companions(
        self, request: BlockRequest, names: list[str], keys: list[str], todo: list[int]
    ) -> None:
        """Store the metadata companions of the objects about to be written (before them: a
        peer that finds an object finds its metadata): one per block, its first object's
        (what ``describe`` reads), and one for every object whose key is a digest of its name
        (the listing names it by its companion). A companion that does not land leaves its
        block without metadata (counted), never unwritten."""
        assert request.block_meta is not None
        parts = len(request.parts)
        chosen = [
            i for i in todo if request.block_meta[i // parts] and _has_companion(keys, i, parts)
        ]
        for lo in range(0, len(chosen), COMPANIONS_PER_CALL):
            chunk = chosen[lo : lo + COMPANIONS_PER_CALL]
            meta_keys = [block_meta.meta_key(keys[i]) for i in chunk]
            # a companion another thread of this client is putting is that thread's to store
            # (the same block, the same metadata): two upserts of one name must not overlap
            with self._writing.held(meta_keys) as mine:
                if not mine:
                    continue
                code = self._puts.call(
                    self._store.upsert_batch,
                    [meta_keys[j] for j in mine],
                    [
                        block_meta.encode(names[chunk[j]], request.block_meta[chunk[j] // parts])
                        for j in mine
                    ],
                    self._replicate,
                )
            if code != 0:
                self._counters.add("block_meta_not_stored", len(mine))
                self._warnings.warning(
                    ("block_meta", code),
                    "mooncake: storing block metadata failed with code %d (%s); those blocks "
                    "are stored without it (further failures logged at debug level)",
                    code,
                    reason(code),
                )

    def _read_companions(self, keys: list[str]) -> list[bytes]:
        # through self, not the client's bound method: a closed backend must hold no client
        return CompanionReader(self._store, self._regions, self._counters).read(keys)

    def _remove_companions(self, keys: list[str], parts: int) -> None:
        """Remove the objects' metadata companions (absent ones are no error)."""
        companions = [
            block_meta.meta_key(k) for i, k in enumerate(keys) if _has_companion(keys, i, parts)
        ]
        codes = self._store.batch_remove(companions, True)
        bad = [c for c in codes if c not in (0, NOT_FOUND)]
        if bad:
            self._counters.add("block_meta_not_removed", len(bad))

    def _objects(self, request: BlockRequest) -> tuple[int, list[str], _Objects]:
        """Parts per block, each object's key, and where each object's bytes are, flat in
        ``[block][part]`` order (read and write requests carry host buffers: io="host")."""
        host = request.host
        assert host is not None
        if host.contiguous:
            ptrs, sizes = host.flat()
            objects = _Objects(ptrs, sizes)
        else:
            pieces = [
                host.segments(block, part)
                for block in range(host.num_blocks)
                for part in range(len(host.nbytes))
            ]
            objects = _Objects(
                [[p for p, _ in obj] for obj in pieces],
                list(host.nbytes) * host.num_blocks,
                [[n for _, n in obj] for obj in pieces],
            )
        return len(request.parts), self._keys(request), objects

    def _master_call(
        self, call: Callable[[list[str]], list[int]], keys: list[str], request: BlockRequest
    ) -> list[int] | Outcome:
        """``call(keys)``, a master RPC that touches no caller memory (``batch_is_exist``,
        ``batch_remove``): its codes, or the hook's answer (0) when no answer came in time.

        With more time left than Mooncake's RPC timeout, the call is made inline (the timeout
        ends it in time); otherwise on a helper thread, abandoned at the deadline.
        """
        left = request.time_left()
        if left <= 0:
            self._counters.add("miss_deadline")
            return Outcome(0, "deadline passed before the master call", FailureKind.DEADLINE)
        if left > self._inline_after_s:
            return list(call(keys))
        with self._stuck_lock:
            if self._stuck >= PROBE_WORKERS:
                self._counters.add("miss_master_unresponsive")
                return Outcome(0, f"mooncake master unresponsive: {self._stuck} calls still wait")
        future = self._probes.submit(call, keys)
        try:
            return list(future.result(timeout=left))
        except FutureTimeout:
            self._counters.add("miss_deadline")
            if not future.cancel():
                with self._stuck_lock:
                    self._stuck += 1
                future.add_done_callback(self._unstick)
            return Outcome(0, "no answer from the master by the deadline", FailureKind.DEADLINE)

    def _unstick(self, _future: object) -> None:
        with self._stuck_lock:
            self._stuck -= 1

    def _get(self, keys: list[str], objects: _Objects, idle: bool) -> tuple[list[int], int]:
        """Read into the objects' memory; a key is done when exactly its object's size arrived.
        An object of another size is not done (0), and removed when the layout says the
        object, not the region, has the wrong size (so a rewrite lands instead of being
        skipped). ``idle``: the caller waits with nothing computing, so the read is polled
        from a lowest-priority thread (:mod:`kv_mooncake.background`)."""
        # the call's third argument: each object's size, or the sizes of its pieces
        sizes: list[int] | list[list[int]]
        if objects.pieces is None:
            get, sizes = self._store.batch_get_into, objects.sizes
        else:
            get, sizes = self._store.batch_get_into_multi_buffers, objects.pieces
        if idle:
            self._counters.add("reads_polled_in_background")
            results = self._idle_reads.call(get, keys, objects.ptrs, sizes)
        else:
            results = get(keys, objects.ptrs, sizes)
        done = []
        for key, r, size in zip(keys, results, objects.sizes, strict=True):
            if r in (size, NOT_FOUND):
                done.append(r)
                continue
            if not self._other_size(key, r, size):
                # not a stored object of another size (asked of the master): a transfer that
                # failed or came back short, which never removes an object that may be whole
                done.append(r if r < 0 else 0)
                continue
            # a smaller object (a count, or -800 from the multi-buffer call) or a larger (-600)
            self._counters.add("miss_size_mismatch")
            if size in (self._payload or {}).values():
                self._counters.add("foreign_removed", self._store.remove(key, True) == 0)
            done.append(0)
        return done, sum(s for r, s in zip(results, objects.sizes, strict=True) if r == s)

    def _other_size(self, key: str, code: int, size: int) -> bool:
        """Whether a get that answered ``code`` (a byte count other than ``size``, or the
        codes another size gives) found the object stored with another size than asked: the
        master's word, so a short or failed transfer of a whole object never counts."""
        if code < 0 and code not in (INVALID_PARAMS, TRANSFER_FAILED):
            return False
        stored = self._store.get_size(key)
        return stored > 0 and stored != size

    def _put(self, keys: list[str], objects: _Objects) -> tuple[list[int], int]:
        """Store ``keys`` (the existence check found none of them stored whole): per key 1
        when stored, else the code; and the bytes moved. See the module docstring for why an
        upsert. A name another thread of this client is putting is not put again (two puts
        of one name by one client publish unwritten buffers, see :mod:`kv_mooncake.inflight`):
        it answers REPLICA_NOT_READY, so the write waits for that put like any other
        writer's."""
        with self._writing.held(keys) as mine:
            if len(mine) == len(keys):
                results = self._put_claimed(keys, objects)
            else:
                self._counters.add("puts_left_to_another_thread", len(keys) - len(mine))
                results = [REPLICA_NOT_READY] * len(keys)
                if mine:
                    put = self._put_claimed([keys[i] for i in mine], objects.pick(mine))
                    for i, r in zip(mine, put, strict=True):
                        results[i] = r
        # -705: another writer stored the same name (hence the same bytes) first; -706: it
        # did, and a reader holds it
        done = [1 if r in (0, ALREADY_EXISTS, HAS_LEASE) else r for r in results]
        return self._racing_puts(keys, done), sum(
            s for r, s in zip(results, objects.sizes, strict=True) if r == 0
        )

    def _put_claimed(self, keys: list[str], objects: _Objects) -> list[int]:
        """The client's put of names this thread holds: per key its answer."""
        if objects.pieces is None:
            return list(
                self._puts.call(
                    self._store.batch_upsert_from,
                    keys,
                    objects.ptrs,
                    objects.sizes,
                    config=self._replicate,
                )
            )
        results = self._puts.call(
            self._store.batch_put_from_multi_buffers,
            keys,
            objects.ptrs,
            objects.pieces,
            config=self._replicate,
        )
        return self._confirm_puts(keys, results)

    def _racing_puts(self, keys: list[str], done: list[int]) -> list[int]:
        """Keys another writer was putting at the same moment (-601): stored once the master
        has them whole (names are content-derived: the same bytes), else still in flight
        (REPLICA_NOT_READY: the write waits for them within its deadline, like any other
        writer's unfinished put), so two writers of one block both get it acknowledged."""
        racing = [i for i, r in enumerate(done) if r == INVALID_WRITE]
        if not racing:
            return done
        self._counters.add("puts_racing_another_writer", len(racing))
        exist = self._store.batch_is_exist([keys[i] for i in racing])
        out = list(done)
        for i, e in zip(racing, exist, strict=True):
            out[i] = 1 if e == 1 else REPLICA_NOT_READY
        return out

    def _confirm_puts(self, keys: list[str], results: list[int]) -> list[int]:
        """The puts that answered stored, asked of the master: a name whose put another writer
        started and never finished answers 0 and stores nothing (REPLICA_NOT_READY, so the
        write waits for it, within its deadline)."""
        answered = [i for i, r in enumerate(results) if r in (0, ALREADY_EXISTS)]
        if not answered:
            return results
        exist = self._store.batch_is_exist([keys[i] for i in answered])
        out = list(results)
        for i, e in zip(answered, exist, strict=True):
            if e != 1:
                out[i] = REPLICA_NOT_READY
                self._counters.add("puts_not_landed")
        return out

    def _transfer(
        self, op: str, keys: list[str], objects: _Objects, request: BlockRequest
    ) -> tuple[list[bool], int | None]:
        """Read or write chunk by chunk: per key whether it succeeded (False after a stop),
        and the failing code that stopped it (None: a miss or the deadline)."""
        ok = [False] * len(keys)
        code = None
        # the table pinned in, not self._regions at the end: a close meanwhile replaces it
        regions = self._regions
        pinned, unregistered = regions.pin(objects.spans())
        self._counters.add("unregistered_spans", unregistered)
        try:
            for lo, hi in _chunks(
                objects.sizes, self.config.max_batch_bytes, self._max_call_pieces, objects.counts()
            ):
                if lo and request.expired():
                    self._counters.add("miss_deadline")
                    break
                done, code = self._transfer_chunk(op, keys, objects, lo, hi, ok, request)
                if not done:
                    break
        finally:
            regions.unpin(pinned)
        return ok, code

    def _transfer_chunk(
        self,
        op: str,
        keys: list[str],
        objects: _Objects,
        lo: int,
        hi: int,
        ok: list[bool],
        request: BlockRequest,
    ) -> tuple[bool, int | None]:
        """Move keys ``[lo, hi)``, filling ``ok``: whether all succeeded, and the code of the
        first that failed (None for a miss: not found, another size; reason counted).

        A read that finds an object whose put is still in flight (another writer's: the
        existence check already counts it) waits for it, with backoff, until the deadline.
        """
        backoff = _READY_POLL_S
        while True:
            chunk = objects.slice(lo, hi)
            pieces = chunk.piece_count()
            if not self._pieces.acquire(pieces, request.time_left()):
                self._counters.add("miss_deadline")  # other calls held the queue until then
                return False, None
            try:
                if op == "read":
                    codes, nbytes = self._get(keys[lo:hi], chunk, request.caller_idle)
                else:
                    codes, nbytes = self._put(keys[lo:hi], chunk)
            finally:
                self._pieces.release(pieces)
            self._counters.add(f"bytes_{op}", nbytes)
            good = [c > 0 for c in codes]
            ok[lo:hi] = good
            if all(good):
                return True, None
            first = good.index(False)
            code = codes[first]
            if code == REPLICA_NOT_READY and request.time_left() > backoff:
                self._counters.add("waits_replica_not_ready")
                time.sleep(backoff)
                backoff = min(backoff * 2, _READY_POLL_MAX_S)
                lo += first  # keys before it are done
                if op == "write":
                    # what the other writer landed meanwhile is stored: putting it again would
                    # only replace its object (same bytes) and race that writer once more
                    landed = leading_run(self._store.batch_is_exist(keys[lo:hi]), 1)
                    ok[lo : lo + landed] = [True] * landed
                    lo += landed
                    if lo == hi:
                        return True, None
                continue
            if code < 0:
                self._counters.add(f"miss_{reason(code)}")
            if code in (NOT_FOUND, REPLICA_NOT_READY) or code >= 0:
                return False, None  # absent, of another size, or still in flight at the deadline
            return False, code

    def _present_run(self, codes: Sequence[int], parts: int) -> int:
        """Leading blocks whose objects all exist; counts why the run ended, and reports a
        failure when an error (not absence) ended it."""
        n = leading_run(codes, parts)
        if n * parts < len(codes):
            first = next(c for c in codes[n * parts :] if c != 1)
            self._counters.add(f"miss_{reason(first) if first < 0 else 'not_found'}")
            if first < 0 and first != NOT_FOUND:
                return Outcome(n, failure("batch_is_exist", first))
        return n


@dataclass(frozen=True)
class _Objects:
    """Where each object's bytes are, in ``[block][part]`` order: one region each (``ptrs``
    are addresses, ``pieces`` None), or pieces (``ptrs[i]`` and ``pieces[i]`` list the
    addresses and sizes of object ``i``'s pieces). ``sizes`` are the objects' whole sizes."""

    ptrs: list[Any]
    sizes: list[int]
    pieces: list[list[int]] | None = None

    def slice(self, lo: int, hi: int) -> _Objects:
        pieces = None if self.pieces is None else self.pieces[lo:hi]
        return _Objects(self.ptrs[lo:hi], self.sizes[lo:hi], pieces)

    def pick(self, indices: Sequence[int]) -> _Objects:
        pieces = None if self.pieces is None else [self.pieces[i] for i in indices]
        return _Objects([self.ptrs[i] for i in indices], [self.sizes[i] for i in indices], pieces)

    def call(self, name: str) -> str:
        """The client call that moves these objects (for failure messages)."""
        return name if self.pieces is None else f"{name}_multi_buffers"

    def piece_count(self) -> int:
        counts = self.counts()
        return len(self.sizes) if counts is None else sum(counts)

    def counts(self) -> list[int] | None:
        """Pieces per object (None: one each)."""
        return None if self.pieces is None else [len(p) for p in self.pieces]

    def spans(self) -> list[tuple[int, int]]:
        """The address spans the objects cover, merged (what must be registered)."""
        if self.pieces is None:
            return merge_spans((p, p + n) for p, n in zip(self.ptrs, self.sizes, strict=True))
        return merge_spans(
            (p, p + n)
            for ptrs, sizes in zip(self.ptrs, self.pieces, strict=True)
            for p, n in zip(ptrs, sizes, strict=True)
        )


def _has_companion(keys: Sequence[str], i: int, parts: int) -> bool:
    """Whether object ``i`` (flat ``[block][part]`` order) gets a metadata companion when its
    block is written with metadata: a block's first object (what ``describe`` reads), and an
    object whose key is a digest of its name (the listing names it by its companion)."""
    return i % parts == 0 or "#" in keys[i]


def _names(request: BlockRequest) -> list[str]:
    """The request's object names, flat in ``[block][part]`` order (as its store keys)."""
    return [name for row in request.object_names for name in row]


def _answer(n: int, code: int | None, call: str) -> int:
    """``n``, as an Outcome that names ``call``'s failing ``code`` when there is one."""
    return n if code is None else Outcome(n, failure(call, code))


def _chunks(
    sizes: Sequence[int],
    budget: int,
    max_pieces: int,
    pieces: Sequence[int] | None = None,
) -> list[tuple[int, int]]:
    """``[lo, hi)`` index ranges of about ``budget`` bytes and at most ``max_pieces`` buffer
    pieces each (``pieces[i]`` for key ``i``, one by default); at least one key each."""
    chunks = []
    lo = total = count = 0
    for i, size in enumerate(sizes):
        total += size
        count += 1 if pieces is None else pieces[i]
        following = 1 if pieces is None or i + 1 == len(sizes) else pieces[i + 1]
        if total >= budget or count + following > max_pieces:
            chunks.append((lo, i + 1))
            lo, total, count = i + 1, 0, 0
    if lo < len(sizes):
        chunks.append((lo, len(sizes)))
    return chunks


# -- closing ----------------------------------------------------------------------------------


def _closed_register(ptr: int, nbytes: int) -> int:
    """What registering memory with a closed client does: nothing."""
    return 0


def _closed_unregister(ptr: int) -> int:
    """What unregistering memory with a closed client does: nothing."""
    return 0


_closing: list[threading.Thread] = []
_CLOSE_AT_EXIT_S = 30.0


def _close_store(
    store: Any, probes: ThreadPoolExecutor, background: Sequence[BackgroundCalls], wait_s: float
) -> None:
    """Close a client, waiting at most ``wait_s`` (it takes 1-3 s, ~20 s after the master
    died); the rest happens on a thread that interpreter exit waits for."""
    thread = start_thread(_quiet_close, "kv-mooncake-close", args=(store, probes, background))
    thread.join(wait_s)
    if thread.is_alive():
        _closing[:] = [t for t in _closing if t.is_alive()]
        _closing.append(thread)


def _quiet_close(
    store: Any, probes: ThreadPoolExecutor, background: Sequence[BackgroundCalls]
) -> None:
    # abandoned existence checks may still be inside the client: let them end (each within
    # MC_RPC_TIMEOUT_MS) before the client goes away under them; puts and reads under way too
    probes.shutdown(wait=True, cancel_futures=True)
    for calls in background:
        calls.close()
    try:
        store.close()
    except Exception:  # closing must never raise into the engine
        log.debug("mooncake: client close raised", exc_info=True)


@atexit.register
def _finish_closing() -> None:
    end = time.monotonic() + _CLOSE_AT_EXIT_S
    for thread in _closing:
        thread.join(max(0.0, end - time.monotonic()))
