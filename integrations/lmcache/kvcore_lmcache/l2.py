"""``KVCoreL2Adapter``: LMCache's L2 storage (multiprocess server) served by any kvcore backend.

LMCache builds it from ``lmcache server --l2-adapter`` with its ``plugin`` type::

    {"type": "plugin", "module_path": "kvcore_lmcache.l2", "class_name": "KVCoreL2Adapter",
     "adapter_params": {"backend": "file", "backend_config": {"root": "/nvme/kvcore"}}}

and calls it from its store and prefetch controller threads. Every call returns at once: the
work runs on the adapter's own threads, and each task's end is signalled on the event fd of
its kind. A backend failure, a closed backend or an object that fails verification is a miss
(a cleared bit, a failed store task), counted in :meth:`KVCoreL2Adapter.report_status` and
logged once per kind, never an exception into LMCache's controllers. Only construction raises
(bad settings, an unknown backend: LMCache's server then fails to start, naming the key).

What LMCache expects of a store, and what this adapter does (docs/lmcache.md has the rest):

- **lookup and lock**: kvcore has no pin. A key found by a lookup is locked here until
  LMCache unlocks it: LMCache's own deletes (its eviction) of a locked key wait for the
  unlock. The backend may still evict it by itself (kv_file's capacity bound); the load is
  then a miss (a cleared bit), which LMCache treats as a miss and recomputes.
- **layout**: every object is stored with its layout (byte size, memory format, shapes,
  dtypes) as block metadata, and a load whose buffer has another layout is a miss: LMCache's
  key has no dtype, so fp16 and bf16 KV of one model are told apart here.
- **usage after a restart**: the store is listed at start and what it holds is reported to
  LMCache (its usage and eviction order start from the store, not from zero).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import (
    EncodedObjectKey,
    KeyEntry,
    KeyListPage,
    MemoryLayoutDesc,
    ObjectKey,
)
from lmcache.v1.distributed.internal_api import L1MemoryDesc, L2AdapterListener, L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

import kvcore
from kvcore import events as ev
from kvcore.keys import ObjectName
from kvcore_lmcache.keys import SaltBook, block_key, key_fields, slice_of
from kvcore_lmcache.layouts import layout_of, parse_layout
from kvcore_lmcache.settings import AdapterSettings
from kvcore_lmcache.store import Store

__all__ = ["PART", "KVCoreL2Adapter", "KVCoreL2AdapterConfig"]

log = logging.getLogger("kvcore_lmcache")

#: The one part each LMCache object is stored as (LMCache's object is already a whole chunk).
PART = "obj"
#: Blocks described per backend call while the store's usage is seeded at start.
SEED_BATCH = 10_000

T = TypeVar("T")


class KVCoreL2AdapterConfig(L2AdapterConfigBase):
    """LMCache's config object for the adapter (found by its plugin loader by the
    ``<class_name>Config`` convention): ``adapter_params`` validated as
    :class:`kvcore_lmcache.settings.AdapterSettings`."""

    def __init__(self, settings: AdapterSettings) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVCoreL2AdapterConfig:
        return cls(AdapterSettings.from_params(d, "lmcache l2 adapter_params for kvcore"))

    @classmethod
    def help(cls) -> str:
        fields = AdapterSettings.model_fields
        lines = [f"- {name}: {field.description}" for name, field in fields.items()]
        return "kvcore L2 adapter (adapter_params):\n" + "\n".join(lines)


def _object_bytes(descs: dict[int, MemoryLayoutDesc]) -> int | None:
    """Bytes of one stored object of the one KV group ``descs`` describes (None: several
    groups, or none: the decision then loads what is found)."""
    if len(descs) != 1:
        return None
    desc = next(iter(descs.values()))
    return sum(
        math.prod(shape) * dtype.itemsize
        for shape, dtype in zip(desc.shapes, desc.dtypes, strict=True)
    )


class _Batch:
    """The keys of one task with their kvcore identities, grouped into runs one backend call
    can take (same object size, rank and tenant: each key's from its ``cache_salt``)."""

    def __init__(
        self,
        keys: Sequence[ObjectKey],
        sizes: Sequence[int] | None,
        tenant_of: Callable[[str], str | None],
    ) -> None:
        self.keys = list(keys)
        self.block_keys = [block_key(k) for k in keys]
        runs: dict[tuple[int, int, int, str | None], list[int]] = {}
        for i, key in enumerate(keys):
            size = sizes[i] if sizes is not None else 0
            run = (size, *slice_of(key.kv_rank), tenant_of(key.cache_salt))
            runs.setdefault(run, []).append(i)
        #: ((object bytes, rank, world size, tenant), indices into keys)
        self.runs = list(runs.items())
        #: the index into keys of each block of a runner's answer (runs in order)
        self.order = [i for _, indices in self.runs for i in indices]

    def answered(self, flags: Sequence[bool]) -> list[int]:
        """The indices into keys of the blocks a runner's answer marks (sorted)."""
        return sorted(i for i, ok in zip(self.order, flags, strict=True) if ok)


class KVCoreL2Adapter(L2AdapterInterface):
    """LMCache's ``L2AdapterInterface`` over the kvcore backend named in ``adapter_params``.

    :param config: a :class:`KVCoreL2AdapterConfig`, or the raw ``adapter_params`` dict.
    :param l1_memory_desc: LMCache's L1 arena (registered with backends that take buffer
        registrations, for zero-copy transports).
    """

    config_class_name = "KVCoreL2AdapterConfig"

    def __init__(
        self,
        config: KVCoreL2AdapterConfig | dict[str, Any] | None = None,
        l1_memory_desc: L1MemoryDesc | None = None,
    ) -> None:
        if not isinstance(config, KVCoreL2AdapterConfig):
            config = KVCoreL2AdapterConfig.from_dict(config or {})
        settings = config.settings
        super().__init__(max_capacity_bytes=settings.max_capacity_bytes)
        self.settings = settings
        self._l1 = l1_memory_desc
        #: each key's tenant, from its cache_salt (the settings' ``tenants``; None: no tenants)
        self._tenant_of: Callable[[str], str | None] = lambda salt: settings.tenant_of(
            salt=salt or None
        )
        self._followers: list[tuple[Any, threading.Thread]] = []
        #: the salts of the keys this server was given (names hold salts' ids only), and the
        #: store's keys whose salt has not come yet
        self._salts = SaltBook()
        self._salts_learnt = threading.Event()  # a salt some waiting keys wait for came
        self._kv = Store(settings, on_open=self._on_open)
        self._counters = self._kv.counters
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._task_ids = itertools.count()
        self._stored_tasks: dict[L2TaskId, L2StoreResult] = {}
        self._looked_up: dict[L2TaskId, Bitmap] = {}
        self._loaded: dict[L2TaskId, Bitmap] = {}
        #: bytes of each key this adapter knows to be stored (its accounting)
        self._sizes: dict[ObjectKey, int] = {}
        #: lookup locks: key -> count, and the deletes waiting for a key's last unlock
        self._locks: dict[ObjectKey, int] = {}
        self._deferred_deletes: set[ObjectKey] = set()
        #: what the store held when it opened (its listing), for listeners registered later
        self._seeded: list[tuple[list[ObjectKey], list[int]]] = []
        self._seeded_all = threading.Event()  # the listing told (or none asked for)
        if not settings.seed_usage:
            self._seeded_all.set()
        #: every lookup, load, store and delete runs here (kvcore's one host path)
        self._runner = self._kv.runner
        backend = self._kv.backend()  # now if it can (a store that is not up: tried again)
        why = None if backend is None else self._kv.layout_unknowable(backend)
        if why is not None:
            self.close()
            raise ValueError(f"lmcache l2 adapter_params for kvcore: verify_layout: {why}")

    # -- the backend -----------------------------------------------------------------------

    def _on_open(self, backend: kvcore.Backend) -> None:
        if self._l1 is not None and self._l1.size:
            backend.register_buffer(self._l1.ptr, self._l1.size)
        # what the store holds (its listing first, with seed_usage: LMCache's usage and
        # eviction order start from the store, not from zero), what it does by itself
        # (evictions) and what others do to it (a shared store), told to LMCache as its
        # listeners' stored/deleted keys
        subscription = backend.events.subscribe(listing=self.settings.seed_usage)
        thread = threading.Thread(
            target=self._follow, args=(subscription,), name="kvcore-lmcache-events", daemon=True
        )
        self._followers.append((subscription, thread))
        thread.start()
        why = self._kv.layout_unknowable(backend)
        if why is not None:  # an open after the start (the store was down then): loads refused
            log.error("kvcore L2 adapter: %s; every load is a miss", why)

    @property
    def backend(self) -> kvcore.Backend | None:
        """The kvcore backend if it is open now (never opens it): its stats, events, tools."""
        return self._kv.opened

    def _backend(self) -> kvcore.Backend | None:
        return self._kv.backend()

    def _checks_layout(self, backend: kvcore.Backend) -> bool:
        return self._kv.checks_layout(backend)

    def _request(
        self,
        backend: kvcore.Backend,
        batch: _Batch,
        run: tuple[tuple[int, int, int, str | None], list[int]],
        objects: Sequence[MemoryObj] | None = None,
        meta: Sequence[bytes] | None = None,
    ) -> kvcore.BlockRequest:
        (size, rank, world, tenant), indices = run
        host = None
        if objects is not None:
            host = kvcore.HostBuffers(
                ptrs=tuple((objects[i].data_ptr,) for i in indices), nbytes=(size,)
            )
        return backend.request(
            f"lmcache-{next(self._task_ids)}",
            [batch.block_keys[i] for i in indices],
            timeout_s=self.settings.timeout_s,
            host=host,
            parts=(PART,),
            part_bytes=(size,) if objects is not None else None,
            rank=rank,
            world_size=world,
            block_meta=meta,
            tenant=tenant,
        )

    # -- event fds -------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # -- tasks -----------------------------------------------------------------------------

    def _guard(self, op: str, default: T, fn: Callable[[], T]) -> T:
        return self._kv.guard(op, default, fn)

    def _task_id(self) -> L2TaskId:
        with self._lock:
            return next(self._task_ids)

    def _batch(self, keys: Sequence[ObjectKey], sizes: Sequence[int] | None) -> _Batch:
        """``keys`` grouped for the backend, their salts learnt (see :meth:`_object_key`)."""
        if self._salts.learn(k.cache_salt for k in keys):
            self._salts_learnt.set()  # the event thread reports the keys that waited
        return _Batch(keys, sizes, self._tenant_of)

    def _object_key(self, text: str) -> ObjectKey | None:
        """The ``ObjectKey`` a block key was made from: None for a name this adapter did not
        build, or one whose salt this server has not seen (its name holds the salt's id)."""
        fields = key_fields(text)
        if fields is None:
            return None
        salt = self._salts.salt_of(fields.salt_id)
        if salt is None:
            return None
        try:
            return ObjectKey(
                chunk_hash=fields.chunk_hash,
                model_name=fields.model_name,
                kv_rank=fields.kv_rank,
                object_group_id=fields.object_group_id,
                cache_salt=salt,
            )
        except ValueError:  # fields LMCache's ObjectKey refuses: not an object it stored
            return None

    def _resolve(self) -> None:
        """Report the stored keys whose salts came since they were seen (as the listing's)."""
        keys = [k for t in self._salts.resolved() if (k := self._object_key(t)) is not None]
        if keys:
            self._counters.add("keys_salt_resolved", len(keys))
            self._seed(keys)

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"store task: {len(keys)} keys for {len(objects)} objects")
        task_id = self._task_id()
        sizes = [obj.get_size() for obj in objects]
        batch = self._batch(keys, sizes)

        def build(backend: kvcore.Backend) -> list[kvcore.BlockRequest]:
            meta = [layout_of(obj) for obj in objects] if self._checks_layout(backend) else None
            return [
                self._request(backend, batch, run, objects, _pick(meta, run[1]))
                for run in batch.runs
            ]

        def done(result: kvcore.HostResult) -> None:
            none: list[int] = []  # what a failed accounting leaves: nothing reported stored
            stored = self._guard("store", none, partial(self._stored, batch, sizes, result))
            written = sum(sizes[i] for i in stored)
            # a key the store's admission policy refused is not a failed store (nothing to
            # retry): the task succeeds when every key was stored or refused
            with self._lock:
                self._stored_tasks[task_id] = L2StoreResult(result.ok, written)
            self._store_efd.notify()

        # each key on its own (LMCache's answers are per key); the store's admission first
        self._runner.submit_write(build, blocks=len(keys), each=True, on_done=done)
        return task_id

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stored_tasks = self._stored_tasks, {}
        return done

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        task_id = self._task_id()
        batch = self._batch(keys, None)

        def build(backend: kvcore.Backend) -> list[kvcore.BlockRequest]:
            return [self._request(backend, batch, run) for run in batch.runs]

        chunk_bytes = _object_bytes(group_layout_descs)

        def done(result: kvcore.HostResult) -> None:
            hits = batch.answered(result.done)
            # the leading run found, cut to what kvcore's load-or-recompute decision loads
            run = next((n for n, i in enumerate(hits) if i != n), len(hits))
            worth = self._kv.worth_loading(run, chunk_bytes, self.settings.chunk_tokens)
            found = Bitmap(len(keys))
            with self._lock:
                for i in hits:
                    if worth <= i < run:
                        continue  # declined: LMCache recomputes it
                    found.set(i)
                    self._locks[keys[i]] = self._locks.get(keys[i], 0) + 1
                self._looked_up[task_id] = found
            self._lookup_efd.notify()

        # each key on its own: a key missing in the middle hides none after it
        self._runner.submit_lookup(build, blocks=len(keys), each=True, on_done=done)
        return task_id

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._looked_up.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        released = []
        with self._lock:
            for key in keys:
                count = self._locks.get(key, 0)
                if count <= 1:
                    self._locks.pop(key, None)
                    if key in self._deferred_deletes:
                        self._deferred_deletes.discard(key)
                        released.append(key)
                else:
                    self._locks[key] = count - 1
        if released:
            self._remove(released, wait=False)

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"load task: {len(keys)} keys for {len(objects)} objects")
        task_id = self._task_id()
        batch = self._batch(keys, [obj.get_size() for obj in objects])

        def build(backend: kvcore.Backend) -> list[kvcore.BlockRequest]:
            if self._kv.layout_unknowable(backend) is not None:
                self._counters.add("load_without_layout", len(keys))
                return []  # refused: nothing read, every key a miss
            return [self._request(backend, batch, run, objects) for run in batch.runs]

        def done(result: kvcore.HostResult) -> None:
            none: list[int] = []  # a failed check loads nothing LMCache may use
            hits = self._guard("load", none, partial(self._loaded_keys, batch, objects, result))
            loaded = Bitmap(len(keys))
            for i in hits:
                loaded.set(i)
            with self._lock:
                self._loaded[task_id] = loaded
            self._load_efd.notify()

        self._runner.submit_read(build, blocks=len(keys), each=True, on_done=done)
        return task_id

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loaded.pop(task_id, None)

    # -- what a task's answer means, on the runner's threads -------------------------------

    def _stored(self, batch: _Batch, sizes: list[int], result: kvcore.HostResult) -> list[int]:
        """The keys a store task stored, reported to LMCache's listeners."""
        stored = batch.answered(result.done)
        self._account_stored([batch.keys[i] for i in stored], [sizes[i] for i in stored])
        return stored

    def _loaded_keys(
        self, batch: _Batch, objects: list[MemoryObj], result: kvcore.HostResult
    ) -> list[int]:
        """The keys a load task read whose stored layout is the buffer's (a key LMCache
        cannot tell apart by dtype is never loaded as another one)."""
        done = list(result.done)
        backend = self._kv.opened
        if backend is not None and self._checks_layout(backend) and any(done):
            at = 0
            for request in result.requests:
                n = request.num_blocks
                if any(done[at : at + n]):
                    described = backend.describe(request)
                    for j in range(n):
                        i = batch.order[at + j]
                        if done[at + j] and described[j] != layout_of(objects[i]):
                            done[at + j] = False
                            self._counters.add("load_layout_mismatches")
                at += n
        hits = batch.answered(done)
        if hits:
            self._notify_keys_accessed([batch.keys[i] for i in hits])
        return hits

    def _remove(self, keys: list[ObjectKey], *, wait: bool = True) -> None:
        """Remove ``keys`` from the store (now, or as a task of the runner's) and tell
        LMCache's listeners they are gone."""
        if not keys:
            return
        batch = self._batch(keys, None)

        def build(backend: kvcore.Backend) -> list[kvcore.BlockRequest]:
            return [self._request(backend, batch, run) for run in batch.runs]

        def gone(result: kvcore.HostResult) -> None:
            if result.failure is not None and not result.requests:
                return  # the store is not open: nothing was removed
            with self._lock:
                dropped = [(k, self._sizes.pop(k)) for k in keys if k in self._sizes]
            if dropped:
                self._notify_keys_deleted([k for k, _ in dropped], [s for _, s in dropped])

        if wait:
            gone(self._runner.remove(build, blocks=len(keys)))
        else:
            self._runner.submit_remove(build, blocks=len(keys), on_done=gone)

    def _follow(self, subscription: Any) -> None:
        """Tell LMCache what the store's event stream reports beyond this adapter's own
        calls: objects the backend evicted or removed (its capacity bound, another server's
        delete) and objects another server stored in a shared store."""
        while not subscription.closed:
            event = subscription.get(timeout=1.0)
            if event is not None:
                self._guard("events", None, partial(self._apply, event))
            if self._salts_learnt.is_set():
                self._salts_learnt.clear()
                self._guard("events", None, self._resolve)
            if not subscription.listing_pending:
                self._seeded_all.set()

    def _apply(self, event: Any) -> None:
        if event.kind == "cleared" or event.kind == "resync":
            return  # after a resync the store is listed again (kvcore's subscription)
        keys: list[ObjectKey] = []
        sizes: list[int] = []
        for ident, size in zip(event.objects, event.sizes or [0] * len(event.objects), strict=True):
            if ident is None or ident.namespace != self.settings.namespace or ident.part != PART:
                continue
            key = self._object_key(ident.block_key)
            if key is not None:
                keys.append(key)
                sizes.append(size)
            elif event.kind == "stored":  # another tenant's, or one whose salt comes later
                waits = self._salts.wait(ident.block_key)
                if waits is not None:  # counted once per key
                    self._counters.add(
                        "keys_unknown_salt" if waits else "keys_unknown_salt_dropped"
                    )
        if not keys:
            return
        if event.kind in ("removed", "evicted"):
            with self._lock:
                gone = [(k, self._sizes.pop(k)) for k in keys if k in self._sizes]
            if gone:
                self._counters.add(f"{event.kind}_by_store", len(gone))
                self._notify_keys_deleted([k for k, _ in gone], [s for _, s in gone])
        elif event.kind == "stored" and event.origin == ev.LISTED:
            self._seed(keys)
        elif event.kind == "stored" and event.origin == ev.PEER:
            self._account_stored(keys, sizes)

    def _account_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        """Report newly stored keys to LMCache (a key stored again is not counted twice)."""
        new_keys, new_sizes = [], []
        with self._lock:
            for key, size in zip(keys, sizes, strict=True):
                if key not in self._sizes:
                    new_keys.append(key)
                    new_sizes.append(size)
                self._sizes[key] = size
        if new_keys:
            self._notify_keys_stored(new_keys, new_sizes)

    # -- eviction, listing, usage ----------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Remove ``keys`` (LMCache's eviction); a key locked by a lookup is removed at its
        last unlock."""
        now = []
        with self._lock:
            for key in keys:
                if self._locks.get(key):
                    self._deferred_deletes.add(key)
                else:
                    now.append(key)
        self._guard("delete", None, lambda: self._remove(now))

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        """The store's keys (every server's, for a shared store), sorted by their kvcore key;
        ``cursor`` is the last key of the previous page."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        listed = sorted(self._listed_keys(), key=lambda pair: pair[0])
        if model_name is not None:
            listed = [(bk, k) for bk, k in listed if k.model_name == model_name]
        if cursor is not None:
            if key_fields(cursor) is None:
                raise ValueError(f"cursor {cursor!r} is not a key this adapter listed")
            listed = [(bk, k) for bk, k in listed if bk > cursor]
        page = listed[:page_size]
        sizes = self._sizes_of([k for _, k in page])
        entries = tuple(
            KeyEntry(key=_encoded(k), size_bytes=size)
            for (_, k), size in zip(page, sizes, strict=True)
        )
        more = len(listed) > page_size
        return KeyListPage(entries=entries, next_page_token=page[-1][0] if more else None)

    def _listed_keys(self) -> list[tuple[str, ObjectKey]]:
        backend = self._backend()
        if backend is None:
            return []
        out = []
        unknown = 0
        namespace = self.settings.namespace
        for name in backend.names():
            ident = ObjectName.parse(name)
            if ident is None or ident.namespace != namespace or ident.part != PART:
                continue
            key = self._object_key(ident.block_key)
            if key is not None:
                out.append((ident.block_key, key))
            elif key_fields(ident.block_key) is not None:
                unknown += 1
        if unknown:  # another server's tenants: their salts never came here
            self._counters.add("listed_keys_unknown_salt", unknown)
        return out

    def _sizes_of(self, keys: list[ObjectKey]) -> list[int]:
        """Each key's bytes: as accounted, else from its stored layout (0 if unknown)."""
        with self._lock:
            sizes = [self._sizes.get(k, -1) for k in keys]
        unknown = [i for i, s in enumerate(sizes) if s < 0]
        backend = self._backend()
        if unknown and backend is not None:
            batch = self._batch([keys[i] for i in unknown], None)
            for run in batch.runs:
                described = backend.describe(self._request(backend, batch, run))
                for j, meta in zip(run[1], described, strict=True):
                    layout = parse_layout(meta)
                    sizes[unknown[j]] = -1 if layout is None else layout.size
        return [max(s, 0) for s in sizes]

    def _seed(self, keys: list[ObjectKey]) -> None:
        """Keys the store held when it opened (its listing): reported to LMCache as stored,
        with their sizes from their stored layouts, and kept for listeners registered later."""
        sizes = self._sizes_of(keys)
        with self._lock:
            fresh = [(k, s) for k, s in zip(keys, sizes, strict=True) if k not in self._sizes]
            for k, s in fresh:
                self._sizes[k] = s
            if fresh:
                self._seeded.append(([k for k, _ in fresh], [s for _, s in fresh]))
        if fresh:
            self._notify_keys_stored([k for k, _ in fresh], [s for _, s in fresh])
        self._counters.add("seeded_keys", len(keys))

    def register_listener(self, listener: L2AdapterListener) -> None:
        """Add ``listener``, telling it what the store held at start (already reported to
        the listeners before it)."""
        with self._lock:
            super().register_listener(listener)
            seeded = list(self._seeded)
        for keys, sizes in seeded:
            listener.on_l2_keys_stored(keys, sizes)

    def wait_seeded(self, timeout: float | None = None) -> bool:
        """Wait for the store's listing to be reported (tests, tools); True once it is."""
        return self._seeded_all.wait(timeout)

    # -- status and close ------------------------------------------------------------------

    def report_status(self) -> dict[str, Any]:
        return {"type": "KVCoreL2Adapter", **self._kv.status()}

    def close(self) -> None:
        if self._kv.closed:
            return
        self._runner.close(finish_queued=True)  # tasks queued, deferred deletes, end first
        backend = self._kv.opened
        for subscription, thread in self._followers:
            subscription.close()
            thread.join(5)
        if backend is not None and self._l1 is not None and self._l1.size:
            backend.unregister_buffer(self._l1.ptr)
        self._kv.close()
        self._store_efd.close()
        self._lookup_efd.close()
        self._load_efd.close()


def _encoded(key: ObjectKey) -> EncodedObjectKey:
    return key.to_encoded_object_key()


def _pick(values: Sequence[T] | None, indices: Sequence[int]) -> list[T] | None:
    return None if values is None else [values[i] for i in indices]
