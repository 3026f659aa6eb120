"""Scheduler side: what the backend can restore, and what the workers must load and save.

Runs in vLLM's engine-core process, next to the scheduler. It never touches KV bytes: it asks
the backend which leading blocks exist (for every TP rank, through one client per KV cache
group, opened for lookups only where the workers run elsewhere) and turns vLLM's scheduling
decisions into :class:`~kvcore_vllm.metadata.StepMetadata` for the workers. Its lookup is the
one presence check of a load: the workers read without asking again.

Block protocol (vLLM's ``KVConnectorBase_V1``):

- ``get_num_new_matched_tokens``: blocks past vLLM's own prefix-cache hit that every rank has,
  capped so at least the prompt's last token is computed (vLLM needs its logits); loaded in
  the step that uses them, or in the background while the request waits outside the batch
  (``load_mode``; always for hybrid models);
- ``update_state_after_alloc``: the blocks vLLM allocated for them become a load;
- ``build_connector_meta``: this step's loads, plus a save of every block that becomes full
  during the step (prompt and, unless disabled, generated tokens);
- ``request_finished`` (``request_finished_all_groups``): a last save of blocks whose tokens
  were not yet known when their step was scheduled; returns True while any save of the request
  may be in flight, so vLLM keeps its blocks until the workers report the saves done
  (``get_finished``).

Hybrid models (vLLM's hybrid KV cache manager on): every KV cache group is stored under keys of
its own (:class:`_GroupStore`). A restore is keyed by the first full-attention group; a
sliding-window group restores only the blocks inside the window of the restored position (the
blocks before it are null placeholders in vLLM's block table and are neither loaded nor saved),
and a restore happens only when every group has what it needs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcore.load_costs import (
    LoadChoice,
    LoadDecider,
    check_load_policy,
)
from kvcore_vllm.backends import connector_handle
from kvcore_vllm.config import ConnectorSettings
from kvcore_vllm.context import Slice, backend_context, slice_plan
from kvcore_vllm.descriptors import BlockDescriber, encode
from kvcore_vllm.events import SchedulerEvents, StoreFollower, events_enabled
from kvcore_vllm.keys import RequestKeys, hashes_shared, key_scope
from kvcore_vllm.layout import CacheGroup, cache_groups, cache_layout
from kvcore_vllm.metadata import BlockRun, StepMetadata
from kvcore_vllm.prefill import engine_prefill
from kvcore_vllm.publisher import EventPublisherRef
from kvcore_vllm.stats import CounterSet

__all__ = ["SchedulerSide"]

log = logging.getLogger("vllm.kvcore_vllm.scheduler")

#: vLLM's placeholder in a block table (a sliding window's blocks before its window)
NULL_BLOCK = 0

#: Boundaries a lookup asks a Mamba group for before it gives up (each one a query)
STATE_PROBES = 8


@dataclass
class _Tracked:
    """A request the connector follows from admission to finish."""

    request: Any  # vllm.v1.request.Request (its token list and block hashes grow)
    saved_upto: int = 0  # blocks 0 .. saved_upto - 1 were handed to the workers to save
    has_saves: bool = False


@dataclass
class _GroupStore:
    """One KV cache group's keys and backends, and the slices of a block a lookup asks for."""

    group: CacheGroup
    layout: Any  # kvcore.CacheLayout
    keys: RequestKeys
    handle: Any  # kvcore.BackendHandle: the group's one lookup client
    slices: list[Slice]


class SchedulerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings) -> None:
        self.settings = settings
        # kv_role: a producer only stores, a consumer only restores, kv_both does both
        role = getattr(vllm_config.kv_transfer_config, "kv_role", None) or "kv_both"
        self.loads_enabled = role in ("kv_consumer", "kv_both")
        self.saves_enabled = role in ("kv_producer", "kv_both")
        self.groups = cache_groups(kv_cache_config)
        #: whether restoring requests wait for their blocks outside the batch (ConnectorSettings)
        self.load_async = settings.load_mode == "async" or (
            settings.load_mode == "auto" and len(self.groups) > 1
        )
        replicated = self.groups[0].kind == "mla"
        per_head = settings.object_layout == "per_head" and not replicated  # MLA: one slice
        self.block_size = int(self.groups[0].spec.block_size)
        hash_block_size = _hash_block_size(vllm_config, kv_cache_config)
        #: why this engine's blocks cannot be named for another process (None: they can)
        self.unshareable = hashes_shared(vllm_config)
        if self.unshareable is not None:
            log.warning(
                "KVCoreConnector shares nothing: %s, so no key names a block for another "
                "process (every lookup a miss, nothing saved); use sha256 or set PYTHONHASHSEED",
                self.unshareable,
            )
        # the slices of a block stored apart: one per rank, one per pipeline stage for MLA's
        # latent, or one per KV head (object_layout per_head); a block is there when all are
        slices = slice_plan(vllm_config, replicated, per_head).all_slices()
        self.world_size = slices[0].world
        self.counters = CounterSet()
        hybrid = len(self.groups) > 1
        #: how the scheduler's lookup client is opened: where the one worker runs in this
        #: process, its data client answers the lookups too (one client; and the ``memory``
        #: backend's data lives in that instance); else a client that only looks up
        self.lookup_role = "data" if self._worker_here(vllm_config) else "lookup"
        self.stores: list[_GroupStore] = []
        for group in self.groups:
            layout = cache_layout(kv_cache_config, per_head=per_head, group=group)
            scope = key_scope(vllm_config, settings, layout, group if hybrid else None)
            # one client asks for every slice (each request names its slice's rank)
            handle = connector_handle(
                settings.backend,
                settings.backend_config,
                backend_context(settings, layout, 0, self.world_size, self.lookup_role),
                retry_s=settings.reopen_interval_s,
                verify_blocks=settings.transfer.get("verify_blocks", "auto"),
            )
            self.stores.append(
                _GroupStore(
                    group=group,
                    layout=layout,
                    keys=RequestKeys(scope, self.block_size, hash_block_size),
                    handle=handle,
                    slices=list(slices),
                )
            )
        # how a restore's other groups are checked: attention runs shrink it, a state picks a
        # boundary inside it, windows check the final end
        order = {"full": 0, "mla": 0, "mamba": 1, "sliding_window": 2}
        self._check_order = sorted(self.stores[1:], key=lambda s: order[s.group.kind])
        primary = self.stores[0]  # the first full-attention (or MLA) group keys restores
        self.layout, self.keys = primary.layout, primary.keys
        self.handles = [store.handle for store in self.stores]
        for handle in self.handles:  # open now: bad settings must fail at start-up
            handle.get()
        self._check_reachable(vllm_config)
        self._kv_cache_manager: Any = None
        self._tracked: dict[str, _Tracked] = {}
        self._hits: dict[str, tuple[int, int]] = {}  # req -> (first block, blocks) found
        self._loads: list[BlockRun] = []
        self._final_saves: list[BlockRun] = []
        self._last_load: dict[str, BlockRun] = {}  # req -> its latest load, to judge failures
        self._lookups_paused_until = 0.0
        #: load or recompute (kvcore.load_costs): fed with this engine's step timings (the
        #: workers time each forward pass; the scheduler knows what it computed)
        prefill, self.prefill_profile = engine_prefill(vllm_config, settings)
        #: vLLM's scheduler building this connector (its publisher, its waiting queue)
        self.vllm_scheduler = EventPublisherRef.of_calling_scheduler()
        self.decider = LoadDecider(
            prefill,
            policy=settings.load_policy,
            margin=settings.load_margin,
            serial=not self.load_async,  # sync loads run inside the step, before its compute
            waiting=self.vllm_scheduler.others_waiting,  # what a sync load holds up
        )
        #: whether the decider's probe reads run with nothing of the engine's computing: the
        #: scheduler runs between steps (no async scheduling) and no load runs beside it
        self.probes_idle = not self.load_async and not getattr(
            vllm_config.scheduler_config, "async_scheduling", False
        )
        self._choices: dict[str, LoadChoice] = {}  # req -> its decision, until allocated
        self._step_batch: list[tuple[int, int]] = []  # (tokens, context) of the step in flight
        self._decider_seen: dict[str, float] = {}
        self.describer = BlockDescriber(self.block_size, self.keys)
        backend = self.handles[0].get()
        #: whether saves carry each block's descriptor (the backend keeps block metadata), so
        #: every engine sharing the store can announce them
        self.describes_blocks = backend is not None and backend.capabilities.block_meta
        #: vLLM's KV events of the store (only when the engine publishes events)
        self.events: SchedulerEvents | None = None
        self.follower: StoreFollower | None = None
        if events_enabled(vllm_config):
            self.events = SchedulerEvents(self.world_size, self.describer)
            if backend is not None:
                self.follower = StoreFollower(
                    self.events,
                    backend,
                    [(piece.rank, piece.world) for piece in primary.slices],
                    primary.layout.parts,
                    self.vllm_scheduler.get,
                    interval_s=settings.events_interval_s,
                )

    def _worker_here(self, vllm_config: Any) -> bool:
        """Whether the engine's one worker runs in this process (vLLM's ``uni`` executor)."""
        parallel = vllm_config.parallel_config
        ranks = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
        return ranks == 1 and parallel.distributed_executor_backend == "uni"

    def _check_reachable(self, vllm_config: Any) -> None:
        """A backend whose data lives inside one process (``memory``) is useful only when the
        workers run in the scheduler's process: otherwise lookups never see what they stored."""
        backend = self.handles[0].get()
        if backend is None or backend.capabilities.shared:
            return
        if not self._worker_here(vllm_config):
            executor = vllm_config.parallel_config.distributed_executor_backend
            raise ValueError(
                f"kvcore backend {self.settings.backend!r} keeps its data inside one process, "
                f"but this engine runs its workers elsewhere (executor {executor!r}, "
                f"{self.world_size} ranks): use a shared backend (file, mooncake), or one rank "
                "with distributed_executor_backend='uni' (on CPU also "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )

    # -- helpers -------------------------------------------------------------------------

    @property
    def token_addressed(self) -> bool:
        backend = self.handles[0].get()
        return backend is not None and backend.capabilities.addressing == "token"

    def _track(self, request: Any) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = _Tracked(request)
            self._tracked[request.request_id] = tracked
        else:
            tracked.request = request
        return tracked

    def _keyable(self, request: Any, blocks: int, op: str) -> int:
        """How many of ``request``'s first ``blocks`` blocks have a key this connector may
        use; a request it cannot key is refused (counted by reason), never guessed at."""
        if self.unshareable is not None:
            self.counters.add(**{f"{op}_refused_unshared_hashes": 1})
            return 0
        keyed = min(blocks, self.keys.blocks_keyed(request))
        if keyed == 0 and blocks > 0:
            # vLLM computes block hashes for every request once a connector is configured;
            # a request without them (a vLLM that did not) cannot be keyed
            self.counters.add(**{f"{op}_refused_unhashed": 1})
        return keyed

    def _tokens(self, request: Any, num_blocks: int) -> list[int] | None:
        if not self.token_addressed:
            return None
        return list(request.all_token_ids[: num_blocks * self.block_size])

    def _lookup(
        self, request: Any, keys: Sequence[str], start: int, store: _GroupStore | None = None
    ) -> int:
        """Leading blocks from ``start`` present on every rank (0 on any failure), in
        ``store``'s group (default: the first)."""
        store = store or self.stores[0]
        if time.monotonic() < self._lookups_paused_until:
            self.counters.add(lookup_requests=1, lookup_blocks=len(keys), lookup_skipped=1)
            return 0
        run = len(keys)
        token_ids = self._tokens(request, start + len(keys))
        errors = 0
        t0 = time.monotonic()
        backend = store.handle.get()
        for piece in store.slices:
            if backend is None:
                errors += 1
                run = 0
                break
            found = backend.query(
                backend.request(
                    f"{request.request_id}/lookup",
                    keys[:run],
                    start_block=start,
                    token_ids=token_ids,
                    timeout_s=self.settings.lookup_timeout_s,
                    rank=piece.rank,
                    world_size=piece.world,
                    tenant=self._tenant_of(request),
                )
            )
            if getattr(found, "failure", None):
                errors += 1
            run = min(run, int(found))
            if run == 0:
                break
        elapsed = time.monotonic() - t0
        # The scheduler waits for every lookup. A backend that fails or answers slowly (a hung
        # server answers only at the deadline) is not asked again for a while: meanwhile
        # every lookup is a miss, so a dead tier costs recomputation, not stalled scheduling.
        if errors or elapsed > self.settings.lookup_timeout_s / 2:
            self._lookups_paused_until = time.monotonic() + self.settings.lookup_backoff_s
            self.counters.add(lookup_pauses=1)
        counts = {
            "lookup_requests": 1,
            "lookup_blocks": len(keys),
            "lookup_hit_blocks": run,
            "lookup_errors": errors,
        }
        if store is not self.stores[0]:  # another group's share, counted apart
            counts = {f"{store.group.kind}_{name}": value for name, value in counts.items()}
        self.counters.add(**counts, lookup_seconds=elapsed)
        return run

    # -- vLLM's scheduler-side calls -------------------------------------------------------

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        bs = self.block_size
        start = num_computed_tokens // bs
        # vLLM computes at least the last prompt token (it needs its logits)
        limit = (request.num_tokens - 1) // bs
        self._hits.pop(request.request_id, None)
        if limit <= start or not self.loads_enabled:
            return 0, False
        tracked = self._track(request)
        limit = self._keyable(request, limit, "lookup")
        if limit <= start:
            return 0, False
        keys = self.keys.keys(request, start, limit)
        found = self._lookup(request, keys, start)
        found = self._other_groups_have(request, start, found)
        if found and len(self.stores) == 1:  # (hybrid: every group loads; decided as stored)
            stored, found = found, self._load_or_recompute(request, keys, start, found)
            if found < stored and start == 0 and tracked.saved_upto == 0:
                # the blocks declined are in the store already: recomputed, they are not saved
                # again (each would be copied to host memory only for the write to find it
                # stored: 96 MB for a 4,000-token prompt, on the cores computing it)
                tracked.saved_upto = stored
        if found:
            self._hits[request.request_id] = (start, found)
        return found * bs, bool(found) and self.load_async

    def _load_or_recompute(self, request: Any, keys: Sequence[str], start: int, found: int) -> int:
        """How many of the ``found`` stored blocks to load: kvcore's decision (load only when
        reading is expected to beat computing), asked once per request until it is allocated
        (vLLM asks again while a request waits for blocks)."""
        rid = request.request_id
        choice = self._choices.get(rid)
        if choice is not None and choice.found == found:
            return choice.blocks
        store = self.stores[0]
        backend = store.handle.get()
        if backend is None:
            return found
        piece = store.slices[0]
        bare = backend.request(  # names only: the size of a block as this store keeps it
            f"{rid}/size",
            keys[:found],
            start_block=start,
            token_ids=self._tokens(request, start + found),
            timeout_s=self.settings.lookup_timeout_s,
            rank=piece.rank,
            world_size=piece.world,
            caller_idle=self.probes_idle,
        )
        choice = self.decider.decide_over(
            backend,
            found,
            # the store's rate unknown for a read this size: the scheduler reads a few of
            # these blocks first, through its own client (a lookup client that cannot read
            # reads nothing: the decision then paces the load itself)
            probe=bare,
            block_bytes=backend.block_nbytes(bare) * len(store.slices),
            block_tokens=self.block_size,
            start_tokens=start * self.block_size,
            prompt_tokens=int(request.num_tokens),
            policy=self._request_policy(request),
        )
        self._choices[rid] = choice
        log.debug("request %s: %s", rid, choice)
        return choice.blocks

    def _tenant_of(self, request: Any) -> str | None:
        """The tenant ``request`` belongs to (``settings.tenants``; None where none are set):
        the one its ``kv_transfer_params["kvcore_tenant"]`` names, else its ``cache_salt``'s,
        else the default tenant. Its blocks are counted (and kept) under it; what it may read
        is its key's business (the salt is in every key), never the tenant's."""
        if self.settings.tenants is None:
            return None
        params = getattr(request, "kv_transfer_params", None) or {}
        named = params.get("kvcore_tenant") if isinstance(params, dict) else None
        return self.settings.tenant_of(
            tenant=named if isinstance(named, str) else None,
            salt=getattr(request, "cache_salt", None),
        )

    def _request_policy(self, request: Any) -> Any:
        """The request's own ``kv_transfer_params["kvcore_load_policy"]``, if it has one (a
        bad value is logged, counted and ignored: the engine's setting applies)."""
        params = getattr(request, "kv_transfer_params", None) or {}
        value = params.get("kvcore_load_policy") if isinstance(params, dict) else None
        if value is None:
            return None
        try:
            return check_load_policy(value, "kv_transfer_params.kvcore_load_policy")
        except ValueError as exc:
            self.counters.add(lookup_bad_load_policy=1)
            log.warning(
                "request %s: %s; using load_policy=%s",
                request.request_id,
                exc,
                self.settings.load_policy,
            )
            return None

    def _other_groups_have(self, request: Any, start: int, found: int) -> int:
        """``found`` blocks from ``start`` as far as every other group can restore them: a
        full-attention group its leading run, a Mamba group the state at the restored
        position (the restore ends at the last boundary inside the run whose state is
        stored), a sliding-window group the whole window before the restored position (else
        nothing: half a window is never loaded). Windows are checked last, at the final end."""
        for store in self._check_order:
            if not found:
                break
            if store.group.is_state:
                found = self._state_boundary(request, store, start, found)
                continue
            end = start + found
            first = max(start, store.group.first_needed_block(end, self.block_size))
            if first >= end:
                continue  # the window lies in vLLM's own cache
            got = self._lookup(request, store.keys.keys(request, first, end), first, store)
            if store.group.window is None:
                found = min(found, first - start + got)
            elif got < end - first:
                self.counters.add(lookup_window_missing=1)
                found = 0
        return found

    def _state_boundary(self, request: Any, store: _GroupStore, start: int, found: int) -> int:
        """Blocks from ``start`` up to the last block (of the first ``found``) whose state
        ``store`` holds; a state is kept at some boundaries only (where vLLM's steps ended), so
        up to :data:`STATE_PROBES` boundaries are asked for, the latest first."""
        for block in range(start + found - 1, max(start, start + found - STATE_PROBES) - 1, -1):
            if self._lookup(request, store.keys.keys(request, block, block + 1), block, store):
                return block + 1 - start
        self.counters.add(lookup_state_missing=1)
        return 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tracked = self._track(request)
        hit = self._hits.pop(request.request_id, None)
        if num_external_tokens <= 0 or hit is None:
            return
        start, found = hit
        n = num_external_tokens // self.block_size
        if n != found:
            log.warning(
                "request %s: vLLM allocated %d external tokens, the lookup found %d blocks",
                request.request_id,
                num_external_tokens,
                found,
            )
            n = min(n, found)
        all_ids = blocks.get_block_ids()
        keys = self.keys.keys(request, start, start + n)
        choice = self._choices.pop(request.request_id, None)
        paced = choice is not None and choice.paced and choice.blocks == n
        run = BlockRun(
            req_id=request.request_id,
            start_block=start,
            keys=keys,
            block_ids=list(all_ids[self.groups[0].index][start : start + n]),
            token_ids=self._tokens(request, start + n),
            group=self.groups[0].index,
            expected_s=choice.expected_s if paced and choice is not None else None,
            break_even_s=choice.break_even_s if paced and choice is not None else None,
            tenant=self._tenant_of(request),
        )
        self._loads.append(run)
        self._last_load[request.request_id] = run
        # (a background load needs nothing more here: vLLM holds the blocks of a request
        # waiting for remote KV, an aborted one's too, until the worker answers it)
        self._loads.extend(self._group_runs(request, all_ids, start, start + n))
        if self.events is not None:
            self.events.known(self.describer.describe(request, keys, start))
        # these blocks are in the store already: saving them again would only re-check them
        if tracked.saved_upto == 0 and start == 0:
            tracked.saved_upto = n

    def _group_runs(
        self,
        request: Any,
        all_ids: Sequence[Sequence[int]],
        first: int,
        end: int,
        saving: bool = False,
    ) -> list[BlockRun]:
        """Blocks ``first .. end - 1`` of every group besides the first that vLLM holds: for a
        load, what a restore of ``end`` blocks needs (a sliding window's blocks inside the
        window); for a save, every held block (a window's blocks before it are null
        placeholders, id 0, by then). Of a Mamba group, the last block only: the one whose
        state the restore continues from, or that this step wrote."""
        runs = []
        for store in self.stores[1:]:
            group = store.group
            ids = list(all_ids[group.index])
            stop = min(end, len(ids))
            if group.is_state:
                start = max(first, stop - 1)
            elif saving:
                start = first
            else:
                start = max(first, group.first_needed_block(end, self.block_size))
            # the held blocks are the tail of the range: start after the last placeholder
            for i in range(stop - 1, start - 1, -1):
                if ids[i] == NULL_BLOCK:
                    start = i + 1
                    break
            if start >= stop:
                continue
            runs.append(
                BlockRun(
                    req_id=request.request_id,
                    start_block=start,
                    keys=store.keys.keys(request, start, stop),
                    block_ids=ids[start:stop],
                    token_ids=self._tokens(request, stop),
                    group=group.index,
                    tenant=self._tenant_of(request),
                )
            )
        return runs

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        so = scheduler_output
        meta = StepMetadata(
            loads=self._loads,
            async_loads=self.load_async,
            saves=self._final_saves,
            preempted=set(so.preempted_req_ids or ()),
        )
        self._loads, self._final_saves = [], []
        for req_id in so.finished_req_ids:
            self._tracked.pop(req_id, None)
            self._hits.pop(req_id, None)
            self._last_load.pop(req_id, None)
            self._choices.pop(req_id, None)
        spec = so.scheduled_spec_decode_tokens or {}
        scheduled: list[tuple[str, int]] = [
            (r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs
        ]
        cached = so.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        # what this step computes, for the prefill rate (its time comes back from the workers)
        self._step_batch = [
            (so.num_scheduled_tokens.get(req_id, 0), computed) for req_id, computed in scheduled
        ]
        for req_id, computed_before in scheduled:
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            # draft tokens may be rejected: their KV is not the sequence's
            n_new = so.num_scheduled_tokens.get(req_id, 0) - len(spec.get(req_id, ()))
            meta.saves.extend(
                self._save_runs(
                    tracked, computed_before + n_new, lambda r=req_id: self._block_ids(r, so)
                )
            )
        return meta

    def _block_ids(self, req_id: str, so: Any) -> tuple[list[int], ...]:
        state = getattr(so, "kv_connector_block_state", None)
        ids = state.get_block_ids(req_id) if state is not None else None
        if ids is None and self._kv_cache_manager is not None:
            ids = self._kv_cache_manager.get_block_ids(req_id)
        return tuple(list(group) for group in ids) if ids else ()

    def _save_runs(
        self, tracked: _Tracked, computed_tokens: int, block_ids_of: Any
    ) -> list[BlockRun]:
        """The blocks that are full once ``computed_tokens`` have KV and are not saved yet, in
        every group (``block_ids_of()``: vLLM's block table, one list per group)."""
        if not self.saves_enabled:
            return []
        request = tracked.request
        tokens = request.all_token_ids
        # a block is keyed by its tokens: with async scheduling the last sampled token may not
        # be known yet; that block is saved at a later step or when the request finishes
        full = min(computed_tokens, len(tokens)) // self.block_size
        if not self.settings.save_decode_blocks:
            full = min(full, request.num_prompt_tokens // self.block_size)
        if full <= tracked.saved_upto:
            return []
        # a block vLLM has not hashed yet (its last token not known) is saved later
        full = self._keyable(request, full, "save")
        if full <= tracked.saved_upto:
            return []
        all_ids = block_ids_of()
        if not all_ids:
            return []
        block_ids = all_ids[self.groups[0].index]
        full = min(full, len(block_ids))
        first = tracked.saved_upto
        if full <= first:
            return []
        keys = self.keys.keys(request, first, full)
        tracked.saved_upto = full
        tracked.has_saves = True
        described = (
            self.describer.describe(request, keys, first)
            if self.events is not None or self.describes_blocks
            else []
        )
        if self.events is not None:
            self.events.remember(described)
        run = BlockRun(
            req_id=request.request_id,
            start_block=first,
            keys=keys,
            block_ids=block_ids[first:full],
            token_ids=self._tokens(request, full),
            group=self.groups[0].index,
            block_meta=[encode(facts) for _, facts in described] if self.describes_blocks else None,
            tenant=self._tenant_of(request),
        )
        return [run, *self._group_runs(request, all_ids, first, full, saving=True)]

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks that failed to load are recomputed by vLLM; save them again afterwards.

        (A backend that found an object corrupt drops it, so the new save heals the store.)
        """
        self._learn_rates(connector_output)
        if self.events is not None and connector_output.kv_cache_events is not None:
            self.events.receive(connector_output.kv_cache_events)
        # a background load that failed: vLLM recomputes the whole request, store it again
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            self._last_load.pop(req_id, None)
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.saved_upto = 0
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        for req_id, run in list(self._last_load.items()):
            bad = [i for i, b in enumerate(run.block_ids) if b in invalid]
            tracked = self._tracked.get(req_id)
            if bad and tracked is not None:
                tracked.saved_upto = min(tracked.saved_upto, run.start_block + bad[0])
                del self._last_load[req_id]

    def _learn_rates(self, connector_output: Any) -> None:
        """The step's forward seconds (timed by the workers) against what it computed feed the
        prefill rate; where the workers read in other processes, their loads feed the store's
        read rate here too (in one process, the shared facade measured them itself)."""
        stats = getattr(connector_output, "kv_connector_stats", None)
        data = getattr(stats, "data", None) or {}
        batch, self._step_batch = self._step_batch, []
        steps = float(data.get("forward_steps", 0.0))
        if steps and batch:
            self.decider.prefill.observe_step(float(data["forward_seconds"]) / steps, batch)
            if self.prefill_profile is not None:
                self.prefill_profile.step_observed()
        if self.lookup_role == "lookup" and data.get("load_measured_bytes"):
            backend = self.stores[0].handle.get()
            if backend is not None:  # a client's first read is no measure (ReadRate.cold)
                backend.read_rate.observe(
                    int(data["load_measured_bytes"]), float(data["load_measured_seconds"])
                )
        self.counters.add(**self._decision_deltas())

    def _decision_deltas(self) -> dict[str, float]:
        """The decision's counters since the last step (``decide_*``)."""
        now = self.decider.counters.snapshot()
        out = {
            f"decide_{name}": value - self._decider_seen.get(name, 0.0)
            for name, value in now.items()
            if value != self._decider_seen.get(name, 0.0)
        }
        self._decider_seen = now
        return out

    def decision_figures(self) -> dict[str, float]:
        """What the decision works from now: the store's read rate, the engine's prefill."""
        backend = self.stores[0].handle.get()
        return self.decider.stats(None if backend is None else backend.read_rate)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        """vLLM without the hybrid manager: the one group's blocks."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        self._hits.pop(request.request_id, None)
        self._last_load.pop(request.request_id, None)
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        tracked.request = request
        self._final_saves.extend(
            self._save_runs(tracked, request.num_computed_tokens, lambda: tuple(block_ids))
        )
        # vLLM keeps the blocks until every worker reports this request's saves finished
        return tracked.has_saves, None

    def close(self) -> None:
        log.info("KVCoreConnector load decisions: %s", self.decision_figures())
        if self.prefill_profile is not None:
            self.prefill_profile.save()
        if self.follower is not None:
            self.follower.close()
        for handle in self.handles:
            handle.close()


def _hash_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """The granularity of ``request.block_hashes`` (vLLM's ``hash_block_size``)."""
    size = getattr(kv_cache_config, "hash_block_size", None)
    if size:
        return int(size)
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
