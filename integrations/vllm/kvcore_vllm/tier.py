"""``KVCoreTier``: any kvcore backend as a secondary tier of vLLM's ``TieringOffloadingSpec``.

vLLM's native offloading puts a CPU primary tier in front of secondary tiers; a secondary tier
moves whole chunks between the primary tier's memory and its store. Selected in
``kv_connector_extra_config``::

    "spec_name": "TieringOffloadingSpec",
    "secondary_tiers": [{"type": "kvcore", "backend": "file",
                         "backend_config": {"root": "/nvme/kv", "capacity_bytes": "500GiB"}}]

(``"type": "kvcore"`` is registered by the package's ``vllm.general_plugins`` entry point;
``{"type": "KVCoreTier", "module_path": "kvcore_vllm.tier"}`` works without it.)

- Data: one chunk is one stored object (part ``chunk``), read into and written from the
  primary tier's own memory: the host buffers point into it, and the region is registered
  with the backend once. A backend that keeps no checksum of its own (``memory``, Mooncake)
  keeps kvcore's block digests beside every chunk itself (:mod:`kvcore.integrity`, the opened
  backend's, for every caller), so a corrupted object is a miss and never reaches the primary
  tier.
- Keys: a chunk's vLLM key (block hash and group) in a kvcore key scoped to the model and its
  K/V-changing settings (RoPE, overrides, quantization, dtypes: ``keys.model_settings``), the
  primary tier's format (vLLM's own run fields: dtype, tokens per hash, chunk size, parallel
  layout), the chunk size and the weight version (:class:`kvcore_vllm.keys.ChunkKeys`).
- Jobs run as kvcore's host jobs (:class:`kvcore.HostRunner`: the store's admission inside
  every store, deadlines, one counter vocabulary), loads apart from stores;
  ``get_finished_jobs`` reports them. A promotion that reads part of its chunks reports
  ``successful_keys``; a store queue past ``max_queued_stores`` drops stores (counted) so a
  slow backend never holds the primary tier's chunks. Lookups are vLLM's asynchronous
  lookups, one batched ``contains`` call per request and step (every gap of the batch in one
  backend call), run by the same runner.
- Failures are misses: a backend error, a corrupt object or a deadline fails the job (or its
  tail); nothing raises into vLLM's scheduler.
- Events (``enable_kv_events``): what the backend's event stream says the store gained and
  lost, evictions and other processes' changes included where the backend reports them; and,
  on attaching, what the store already holds (listed once after subscribing, announced over
  the next steps, ``LISTED_PER_STEP`` objects a step), so an engine attached to a store others
  filled announces its chunks. vLLM pulls the events at its steps and translates them itself
  (its offloading events tracker, scheduler-thread state), so they leave when the engine
  steps: an idle engine publishes nothing until its next step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from functools import partial
from typing import Any, ClassVar, Literal

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

import kvcore
from kvcore import events as ev
from kvcore.estimates import PrefillRate
from kvcore.load_costs import LoadDecider
from kvcore.requests import HostBuffers
from kvcore.runner import COUNTERS
from kvcore_vllm.config import load_tier_settings
from kvcore_vllm.keys import ChunkKeys, chunk_scope, tier_engine_config

__all__ = ["KVCoreTier"]

log = logging.getLogger("vllm.kvcore_vllm.tier")
#: The object part of a chunk.
PART = "chunk"
#: listed objects of the store announced per step after attaching (a step stays short)
LISTED_PER_STEP = 4096
#: chunks the tier remembers having announced (to send removals only for those)
ANNOUNCED_CHUNKS = 200_000
#: Prometheus names of the tier's own counters (labelled by tier type), and what they count;
#: its jobs' are kvcore's runner's (``host_<name>``, labelled by tier type and op: ``lookup``,
#: ``read`` for promotions, ``write`` for stores; :data:`kvcore.runner.COUNTERS`)
_COUNTERS = {
    "events_unmapped": "store events naming objects outside this tier's key scope (skipped)",
    "chunks_declined": "chunks found but answered absent: reading them was expected to take "
    "longer than computing them (kvcore.load_costs; prefill_tokens_per_s)",
}


def _metric(name: str) -> str:
    return f"vllm:kv_offload_tiering_kvcore_{name}"


class StoreUnavailable(RuntimeError):
    """The tier's backend is not open (it failed to open and is tried again on schedule)."""


class _Lookups(AsyncLookupManager):
    """vLLM's asynchronous lookups; each request's batch is one ``contains`` call."""

    def __init__(self, tier: KVCoreTier, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> list[bool]:
        return self._tier._exists(keys, req_context.req_id)


class KVCoreTier(SecondaryTierManager):
    """A secondary tier stored by any installed kvcore backend (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **settings: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = cfg = load_tier_settings(settings)  # bad settings fail start-up
        kvcore.check_backend_config(cfg.backend, cfg.backend_config)
        self.locality = Locality(cfg.locality) if cfg.locality is not None else None
        region = np.asarray(primary_kv_view).reshape(-1).view(np.uint8)
        self._base = int(region.ctypes.data)
        self._chunk_bytes = int(primary_kv_view.strides[0])
        self._num_chunks = int(primary_kv_view.shape[0])
        self._region_bytes = self._num_chunks * self._chunk_bytes
        engine_config = tier_engine_config()
        if engine_config is None:
            log.warning(
                "kvcore tier: the engine's model settings are not visible here (no vLLM config "
                "in scope): chunks are keyed for this process alone, never shared with another"
            )
        self.keys = ChunkKeys(chunk_scope(offloading_spec, cfg, self._chunk_bytes, engine_config))
        context: dict[str, Any] = {"namespace": cfg.namespace}
        self._namespace = cfg.namespace
        if cfg.weight_version:
            context["weight_version"] = cfg.weight_version
        self._store_override: kvcore.Backend | None = None
        self._events: list[OffloadingEvent] | None = None
        self._subscription: ev.Subscription | None = None
        self._announced: ev.Announced[OffloadKey, OffloadKey] = ev.Announced(ANNOUNCED_CHUNKS)
        if cfg.enable_kv_events:
            events_config = getattr(offloading_spec, "kv_events_config", None)
            if events_config is not None and events_config.enable_kv_cache_events:
                self._events = []
            else:
                log.warning(
                    "kvcore tier: enable_kv_events is set but vLLM's KV cache events are off "
                    "(kv_events_config); the tier publishes none"
                )
        # the tier stores chunks by key from host memory. A store that cannot be reached
        # does not stop the engine: every lookup is a miss, every job fails (vLLM recomputes),
        # and the handle tries again every reopen_interval_s (bad settings still raise here)
        self._handle = kvcore.BackendHandle(
            cfg.backend,
            cfg.backend_config,
            context=context,
            requires={"io": "host", "addressing": "key"},
            retry_s=cfg.reopen_interval_s,
            on_open=self._attach,
        )
        self._handle.get()
        self._counts = kvcore.Counters()  # the tier's own (events_unmapped)
        self._reported: dict[str, float] = {}  # each counter's total last handed to vLLM
        #: loads and stores as kvcore's host jobs, loads apart from stores; a store past
        #: max_queued_stores is dropped (a future miss), a load never is
        self._runner = kvcore.HostRunner(
            self._current_store,
            name="vllm-tier",
            read_workers=cfg.load_workers,
            write_workers=cfg.store_workers,
            max_queued=(1 << 20, cfg.max_queued_stores),
        )
        self._closed = False
        #: load or recompute (kvcore.load_costs): a tier sees no engine step, so the prefill
        #: rate is the settings' ``prefill_tokens_per_s`` (unset: every chunk found is promoted)
        self._decider = LoadDecider(
            PrefillRate(tokens_per_s=cfg.prefill_tokens_per_s),
            policy=cfg.load_policy,
            margin=cfg.load_margin,
        )
        groups = getattr(offloading_spec, "tokens_per_block", None) or (0,)
        self._chunk_tokens = int(groups[0]) * int(getattr(offloading_spec, "blocks_per_chunk", 1))
        self._lookups = _Lookups(self, tier_type)
        log.info(
            "kvcore tier %r: backend %r, %d chunks of %d bytes registered, namespace %r",
            tier_type,
            cfg.backend,
            self._num_chunks,
            self._chunk_bytes,
            cfg.namespace,
        )

    def _attach(self, backend: kvcore.Backend) -> None:
        """What each opened backend gets once: the primary tier's region, registered for every
        job, and the tier's event subscription."""
        backend.register_buffer(self._base, self._region_bytes)
        if self._events is not None:
            # what the store holds first (kvcore lists it after subscribing: none missed),
            # then its changes; listed again after a resync
            self._subscription = backend.events.subscribe(listing=True)

    @property
    def backend(self) -> kvcore.Backend | None:
        """The opened backend; None while it cannot be opened (tried again on schedule)."""
        return self._handle.get()

    @property
    def store(self) -> kvcore.Backend:
        """What jobs read, write and query through: the opened backend (which verifies its
        chunks itself, kvcore.integrity), or what a test put in its place to inject faults.

        :raises StoreUnavailable: the backend is not open (the job fails, as a miss)."""
        store = self._current_store()
        if store is None:
            raise StoreUnavailable(f"backend {self.settings.backend!r} is not open")
        return store

    @store.setter
    def store(self, wrapped: kvcore.Backend) -> None:
        self._store_override = wrapped

    def _current_store(self) -> kvcore.Backend | None:
        """The runner's backend: the store (None while it cannot be opened)."""
        backend = self._handle.get()
        if backend is None:
            return None
        return self._store_override if self._store_override is not None else backend

    # -- vLLM's tier contract -----------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit("write", job_metadata, self.settings.store_timeout_s)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit("read", job_metadata, self.settings.load_timeout_s)

    def _submit(self, op: Literal["read", "write"], job: TransferJob, timeout_s: float) -> None:
        """``job`` as a job of kvcore's runner (its request built on the runner's thread)."""
        task = f"{'store' if op == 'write' else 'load'}/{job.job_id}"
        build = partial(self._request, task, job.keys, job.chunk_ids)
        self._runner.submit(op, build, blocks=len(job.keys), tag=job, timeout_s=timeout_s)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return [self._job_result(done) for done in self._runner.get_finished()]

    def _job_result(self, done: kvcore.HostResult) -> JobResult:
        """A finished job as vLLM's result. A store succeeds when every chunk was stored or
        refused by the store's admission (a refusal is nothing to retry); a promotion reports
        the leading chunks it read, and the rest become misses for the requests that looked
        them up, so the scheduler does not promote them again and again (vLLM's livelock
        #49176)."""
        job: TransferJob = done.tag
        if done.op == "write":
            return JobResult(
                job.job_id, success=done.ok, transfer_time=done.seconds, transfer_bytes=done.bytes
            )
        keys = list(job.keys)
        read = done.leading  # the chunks past the leading run hold no usable bytes
        if read < len(keys):
            self._lookups.mark_miss(keys[read:])
        return JobResult(
            job.job_id,
            success=read == len(keys),
            successful_keys=tuple(keys[:read]) if 0 < read < len(keys) else None,
            transfer_time=done.seconds,
            transfer_bytes=read * self._chunk_bytes,
        )

    def has_pending_work(self) -> bool:
        return self._runner.pending > 0 or self._runner.ready > 0

    def drain_jobs(self) -> None:
        """Every submitted job ends: each backend call ends by its deadline (a stuck one is
        answered at the deadline, the tier does not wait past it)."""
        self._runner.wait()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._subscription is None or self._events is None:
            return ()
        # at most LISTED_PER_STEP objects a step: a step stays short while a large store's
        # listing is announced
        for event in self._subscription.drain(max_objects=LISTED_PER_STEP):
            self._translate(event)
        events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        """Finish running jobs (bounded by their deadlines), stop every thread, close the
        backend: no kvcore thread or store file is left."""
        if self._closed:
            return
        self._closed = True
        self._runner.close()  # queued jobs answered as cancelled, running ones end first
        self._lookups.shutdown()
        if self._subscription is not None:
            self._subscription.close()
        backend = self._handle.opened
        if backend is not None:
            backend.unregister_buffer(self._base)
        self._handle.close()

    # -- metrics ------------------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        defs: dict[str, OffloadingMetricMetadata] = {
            _metric(name): OffloadingCounterMetadata(documentation=doc, labelnames=("tier",))
            for name, doc in {**_COUNTERS, **_FACADE_COUNTERS}.items()
        }
        for name, doc in COUNTERS.items():
            defs[_metric(f"host_{name}")] = OffloadingCounterMetadata(
                documentation=f"the kvcore tier's jobs: {doc}", labelnames=("tier", "op")
            )
        return defs

    def get_stats(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        totals: dict[tuple[str, tuple[str, ...]], float] = {}
        for key, value in self._counts.snapshot().items():
            totals[(key, (self.tier_type,))] = value
        for key, value in self._runner.stats("").items():  # "<name>.<op>"
            name, _, op = key.partition(".")
            if name in COUNTERS:
                totals[(f"host_{name}", (self.tier_type, op))] = value
        backend = self._handle.opened
        snapshot = backend.metrics.snapshot() if backend is not None else {}
        for name, keys in _FACADE_COUNTERS_FROM.items():
            now = sum(v for k, v in snapshot.items() if k.split(".")[0] in keys)
            totals[(name, (self.tier_type,))] = now
        for (name, labels), now in totals.items():  # vLLM takes what grew since the last call
            step = now - self._reported.get(f"{name}{labels}", 0.0)
            if step:
                stats.increase_counter(_metric(name), step, labels)
                self._reported[f"{name}{labels}"] = now
        return None if stats.is_empty() else stats

    # -- the work -----------------------------------------------------------------------------

    def _request(
        self,
        task: str,
        keys: Collection[OffloadKey],
        chunk_ids: Any,
        backend: kvcore.Backend,
        timeout_s: float | None = None,
    ) -> kvcore.BlockRequest:
        """The request of ``keys`` (into or out of the primary tier's ``chunk_ids``, when
        given), built by the runner from the opened backend."""
        host = None
        if chunk_ids is not None:
            base, size = self._base, self._chunk_bytes
            ids = [int(c) for c in chunk_ids]
            if any(not 0 <= c < self._num_chunks for c in ids):
                raise ValueError(f"chunk ids {ids} outside the primary tier's {self._num_chunks}")
            host = HostBuffers(ptrs=tuple((base + c * size,) for c in ids), nbytes=(size,))
        return backend.request(
            task,
            [self.keys.key(k) for k in keys],
            timeout_s=timeout_s,
            host=host,
            parts=(PART,),
            part_bytes=(self._chunk_bytes,),
            # vLLM's offloading calls carry block hashes, no request (so no salt): the
            # settings' default tenant, one per engine (None without tenants)
            tenant=self.settings.tenant_of(),
        )

    def _exists(self, keys: list[OffloadKey], req_id: str) -> list[bool]:
        """Which of ``keys`` are stored: one ``contains`` call for the whole batch, gaps
        included (none while the store is not open)."""
        build = partial(
            self._request, f"{req_id}/lookup", keys, None, timeout_s=self.settings.lookup_timeout_s
        )
        found = list(self._runner.lookup(build, blocks=len(keys), each=True).done)
        return self._worth_loading(found, build)

    def _worth_loading(
        self, found: list[bool], probe: Callable[[kvcore.Backend], kvcore.BlockRequest]
    ) -> list[bool]:
        """``found``, its leading run cut to what kvcore's decision would load (a chunk whose
        read is expected to take longer than computing it is answered absent)."""
        run = next((i for i, hit in enumerate(found) if not hit), len(found))
        if run == 0 or self._chunk_tokens <= 0:
            return found
        choice = self._runner.plan_load(
            self._decider,
            run,
            block_bytes=self._chunk_bytes,
            block_tokens=self._chunk_tokens,
            probe=probe,
        )
        if choice.declined:
            self._counts.add("chunks_declined", choice.declined)
            found[choice.blocks : run] = [False] * choice.declined
        return found

    def _translate(self, event: ev.StoreEvent) -> None:
        """One kvcore event as vLLM's tier-owned offloading events."""
        assert self._events is not None
        if event.kind in (ev.CLEARED, ev.RESYNC):
            # vLLM's events name chunks; "everything of this tier" has none of its own: every
            # chunk announced is removed (after a resync, the store is listed again)
            gone = self._announced.clear()
            if gone:
                self._append_event(gone, True)
            return
        removed = event.kind != ev.STORED
        keys: list[OffloadKey] = []
        unmapped = 0
        for identity in event.objects:
            if identity is None or identity.part != PART:
                continue  # block digests beside chunks (kvcore.integrity), others' objects
            key = self.keys.offload_key(identity)
            if key is None:
                unmapped += 1
            else:
                keys.append(key)
        if unmapped:
            self._counts.add("events_unmapped", unmapped)
        keys = self._announce(keys, removed)
        if not keys:
            return
        self._append_event(keys, removed)

    def _announce(self, keys: list[OffloadKey], removed: bool) -> list[OffloadKey]:
        """What of ``keys`` to tell vLLM: stores once, removals only of chunks announced
        (a router never hears of a chunk leaving that it was not told of). Past
        ``ANNOUNCED_CHUNKS`` the oldest announced chunk is withdrawn (a removal), so vLLM never
        keeps one the tier no longer follows."""
        announced = self._announced
        if removed:
            return [k for k in keys if announced.remove(k) is not None]
        new = [k for k in dict.fromkeys(keys) if k not in announced]
        withdrawn = [gone for k in new for gone in announced.announce(k, k)]
        if withdrawn:
            self._append_event(withdrawn, True)
        return new

    def _append_event(self, keys: list[OffloadKey], removed: bool) -> None:
        assert self._events is not None
        last = self._events[-1] if self._events else None
        if last is not None and last.removed == removed:
            last.keys.extend(keys)  # one event per run of stores (or removals), as vLLM's tiers
            return
        self._events.append(
            OffloadingEvent(
                keys=keys,
                medium=self.medium,
                removed=removed,
                locality=self.locality,
                ownership=self.tier_type,
                removal_expected=True,
            )
        )


#: kvcore's own facade counters reported per tier: name -> documentation
_FACADE_COUNTERS = {
    "backend_errors": "backend calls of the kvcore tier that raised (counted as misses)",
    "backend_failures": "backend calls that reported a failure (an I/O error, a corrupt object)",
    "backend_deadline_misses": "backend calls of the kvcore tier that answered past a deadline",
}
#: which facade counters (prefixes of ``Backend.metrics.snapshot()`` keys) each one sums
_FACADE_COUNTERS_FROM = {
    "backend_errors": ("errors", "invalid_results"),
    "backend_failures": ("failures_reported", "corrupt_blocks"),
    "backend_deadline_misses": ("deadline_missed",),
}
