"""Worker side: loads and saves through kvcore's TransferManager, over vLLM's own KV tensors.

Runs in each vLLM worker. ``register_kv_caches`` maps the per-layer tensors onto a kvcore
``DeviceCache`` (no copy; see :mod:`kvcore_vllm.layout`) and builds a ``TransferManager`` over
the opened backend, so every byte moves through kvcore's swap ops, staging and backend calls.

- Loads read what the scheduler's lookup found, asking no query first. In ``sync`` load mode
  they are synchronous with the step: the scheduler already counted the blocks as computed,
  so ``start_load_kv`` submits every load of the step and waits for them (each bounded by
  ``load_timeout_s``). Blocks that did not arrive are reported by
  ``get_block_ids_with_load_errors`` and vLLM recomputes them: a miss, a corrupt object or a
  dead backend costs recomputation, never a wrong token. In ``async`` mode the request waits
  outside the batch and ``get_finished`` answers it once its loads are in; blocks that did not
  load are reported as in ``sync`` mode and vLLM recomputes from the first of them (a model with
  several KV cache groups: the request is reported in ``failed_recving`` and recomputed whole).
- Saves are asynchronous: ``wait_for_save`` hands the step's full blocks to the manager's write
  pool and returns. vLLM keeps a finished request's blocks until ``get_finished`` reports its
  saves done; a preempted request's saves are waited for in ``handle_preemptions``, before
  vLLM reuses its blocks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import kvcore
from kvcore.schemas import ReadTask, WriteTask
from kvcore.transfer import DeviceCache, TransferManager
from kvcore_vllm.backends import connector_handle
from kvcore_vllm.config import ConnectorSettings
from kvcore_vllm.context import HeadSlices, Slice, backend_context, slice_plan
from kvcore_vllm.events import BlockEvents, WorkerEvents, events_enabled
from kvcore_vllm.layout import (
    CacheGroup,
    LayerMapping,
    cache_groups,
    cache_layout,
    map_layer_tensors,
    map_state_tensors,
)
from kvcore_vllm.metadata import BlockRun, StepMetadata
from kvcore_vllm.stats import CounterSet, delta

__all__ = ["WorkerSide", "worker_rank"]

log = logging.getLogger("vllm.kvcore_vllm.worker")


def worker_rank() -> int:
    """This worker's rank among the engine's TP x PP ranks (the rank in object names)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp = get_tp_group()
    return get_pp_group().rank_in_group * tp.world_size + tp.rank_in_group


@dataclass
class _GroupIO:
    """One KV cache group's storage on this rank: its layout, backend, tensors, manager."""

    group: CacheGroup
    layout: kvcore.CacheLayout
    handle: Any  # kvcore.BackendHandle
    mapping: LayerMapping | None = None
    cache: DeviceCache | None = None
    manager: TransferManager | None = None


class WorkerSide:
    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        settings: ConnectorSettings,
        rank: int | None = None,
    ) -> None:
        self.settings = settings
        groups = cache_groups(kv_cache_config)
        replicated = groups[0].kind == "mla"
        per_head = settings.object_layout == "per_head" and not replicated  # MLA: one slice
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        #: this worker's rank among the engine's TP x PP ranks
        self.engine_rank = engine_rank = worker_rank() if rank is None else rank
        self.plan = slice_plan(vllm_config, replicated, per_head)
        #: the slices of every block this rank restores (and writes, where ``writes``): its
        #: own (per rank), its stage's (MLA, shared by its TP ranks) or one per KV head it holds
        self.slices = self.plan.slices(engine_rank)
        self.world_size = self.slices[0].world
        self.rank = self.slices[0].rank
        #: whether this rank stores anything (MLA: one TP rank of each stage does)
        self.writer = any(piece.writes for piece in self.slices)
        #: every group's storage by vLLM's group index; the first one keys restores
        self.io: dict[int, _GroupIO] = {}
        for group in groups:
            layout = cache_layout(kv_cache_config, per_head=per_head, group=group)
            handle = connector_handle(
                settings.backend,
                settings.backend_config,
                backend_context(settings, layout, self.rank, self.world_size),
                retry_s=settings.reopen_interval_s,
                verify_blocks=settings.transfer.get("verify_blocks", "auto"),
            )
            self.io[group.index] = _GroupIO(group, layout, handle)
        self._primary = self.io[groups[0].index]
        self.layout = self._primary.layout
        self.layer_names = list(groups[0].layer_names)
        self.handle = self._primary.handle
        self.counters = CounterSet()
        self._on_gpu = False
        self._lock = threading.Lock()
        self._inflight: dict[str, set[Future]] = {}  # req -> its saves not yet answered
        self._with_saves: set[str] = set()  # reqs the scheduler delays freeing for
        self._finished: set[str] = set()  # of those, the ones vLLM finished
        self._load_errors: set[int] = set()
        self._step_t0: float | None = None
        #: whether vLLM can map a failed block's id back to its request: with one KV cache
        #: group, block ids are unique and a background load that failed part-way keeps the
        #: blocks before the failure; with several, vLLM accepts only whole failed requests
        self._block_errors_name_requests = len(kv_cache_config.kv_cache_groups) == 1
        #: requests loading in the background: (when submitted, their runs and futures)
        self._loading: dict[str, tuple[float, list[tuple[BlockRun, list[Future | None]]]]] = {}
        #: requests loading in the background whose reads include a client's first
        self._cold_loads: set[str] = set()
        self._snapshots: dict[str, dict[str, float]] = {}
        self._closed = False
        self._events_wanted = events_enabled(vllm_config)
        self.events: WorkerEvents | None = None

    # -- set-up ----------------------------------------------------------------------------

    # the first group's storage, by the names the single-group connector had
    @property
    def mapping(self) -> LayerMapping | None:
        return self._primary.mapping

    @property
    def cache(self) -> DeviceCache | None:
        return self._primary.cache

    @property
    def manager(self) -> TransferManager | None:
        return self._primary.manager

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        pieces = self.plan.pieces if isinstance(self.plan, HeadSlices) else 0
        for io in self.io.values():
            names = list(io.group.layer_names)
            io.mapping = (
                map_state_tensors(kv_caches, names, io.layout, self.num_blocks)
                if io.group.is_state
                else map_layer_tensors(kv_caches, names, io.layout, self.num_blocks, pieces)
            )
            io.cache = DeviceCache(io.mapping.layout, io.mapping.k, io.mapping.v)
            self._on_gpu = bool(getattr(io.cache, "on_gpu", False))
            log.info(
                "KVCoreConnector rank %d: slice r%dof%d (%s), group %d (%s), %d layers x %d "
                "blocks (%s form) on backend %r",
                self.engine_rank,
                self.rank,
                self.world_size,
                "stores and reads" if self.writer else "reads; another TP rank stores it",
                io.group.index,
                io.group.kind,
                len(names),
                self.num_blocks,
                io.mapping.kv_format,
                self.settings.backend,
            )
        self._transfer_manager()

    def _transfer_manager(self, group: int | None = None) -> TransferManager | None:
        """The manager of ``group`` (default: every group's, the first returned), built once
        its backend is open (it may open late: see backends)."""
        if group is None:
            for index in self.io:
                if index != self._primary.group.index:
                    self._transfer_manager(index)
            group = self._primary.group.index
        io = self.io[group]
        if io.manager is not None or io.cache is None or self._closed:
            return io.manager
        backend = io.handle.get()
        if backend is None:
            return None
        config: dict[str, Any] = {
            "layout": io.cache.layout,  # the mapping's: see LayerMapping.layout
            "max_model_len": self.max_model_len,
            "rank": self.rank,
            "world_size": self.world_size,
            "namespace": self.settings.namespace,
            "weight_version": self.settings.weight_version,
            "default_timeout_s": self.settings.save_timeout_s,
            # a full write queue must answer at once: the forward pass never waits on storage
            "submit_wait_s": 0.0,
            **self.settings.transfer,
        }
        io.manager = TransferManager(config, io.cache, backend)
        if self._events_wanted and self.events is None and io is self._primary:
            self.events = WorkerEvents(
                backend, [piece.rank for piece in self.slices], self.world_size, self.layout.parts
            )
        return io.manager

    # -- loads -----------------------------------------------------------------------------

    # -- the step's compute, timed for the load-or-recompute decision ---------------------

    def step_started(self) -> None:
        """vLLM bound this step's metadata: its forward pass is next (after sync loads)."""
        self._step_t0 = time.monotonic()

    def step_computed(self) -> None:
        """The step's forward pass ended: its seconds (loads excluded) go to the scheduler,
        which knows what the step computed (``forward_seconds``, ``forward_steps``)."""
        t0, self._step_t0 = self._step_t0, None
        if t0 is not None:
            self.counters.add(forward_seconds=time.monotonic() - t0, forward_steps=1)

    def start_load_kv(self, meta: StepMetadata) -> None:
        if not meta.loads:
            return
        assert self.mapping is not None, "register_kv_caches was not called"
        t0 = time.monotonic()
        # a sync load is made before the step computes: nothing of the engine's runs meanwhile
        pending, cold = self._submit_loads(meta.loads, idle=not meta.async_loads)
        if meta.async_loads:
            # answered by get_finished once every run of the request is in; until then vLLM
            # keeps the request out of the batch and its blocks allocated (also when it is
            # aborted: vLLM frees them on this answer, so no load writes into reused blocks)
            with self._lock:
                for run, futures in pending:
                    self._loading.setdefault(run.req_id, (t0, []))[1].append((run, futures))
                    if cold:
                        self._cold_loads.add(run.req_id)
            return
        failed = self._collect_loads(pending, t0, cold)
        with self._lock:
            self._load_errors.update(failed)
        if self._step_t0 is not None:  # the step's compute starts once its loads are in
            self._step_t0 = time.monotonic()

    def _submit_loads(
        self, runs: list[BlockRun], idle: bool
    ) -> tuple[list[tuple[BlockRun, list[Future | None]]], bool]:
        """Start reading ``runs``: for each, one read per slice this rank holds (``idle``:
        the engine waits for them computing nothing, :attr:`kvcore.ReadTask.caller_idle`).
        Also whether one of them is a client's first read
        (:attr:`kvcore.estimates.ReadRate.cold`): it pays for the client's setup, so its
        time says little of the store's rate."""
        pending: list[tuple[BlockRun, list[Future | None]]] = []
        cold = False
        for run in runs:
            manager = self._transfer_manager(run.group)
            backend = None if manager is None else manager.backend
            cold = cold or (backend is not None and backend.read_rate.cold)
            futures: list[Future | None] = []
            for piece in self.slices:  # every slice this rank holds, written here or not
                fut = None
                if manager is not None:
                    task = self._task(run, "load", self.settings.load_timeout_s, piece, idle)
                    try:
                        fut = manager.read(task)
                    except Exception as exc:  # a refused task is a miss, never a crash
                        log.warning("KVCoreConnector: load of %s refused: %s", run.req_id, exc)
                futures.append(fut)
            pending.append((run, futures))
        return pending, cold

    def _collect_loads(
        self, pending: list[tuple[BlockRun, list[Future | None]]], t0: float, cold: bool
    ) -> list[int]:
        """Wait for ``pending`` loads, count them, and return vLLM's ids of the blocks that
        did not load (a block is restored when every slice of it is). Loads that are no
        client's first read (``cold``) are also counted as ``load_measured_*``: what the
        scheduler's read rate learns from, where the workers run in other processes."""
        nbytes = asked = done = runs = cut = 0
        expected = 0.0
        failed: list[int] = []
        other_groups: dict[str, float] = {}
        for run, futures in pending:
            got = run.num_blocks
            was_cut = False
            for fut in futures:
                read = 0
                if fut is not None:
                    try:
                        result = fut.result()
                        read = int(result.num_blocks)
                        was_cut |= result.outcome == "cut"
                    except Exception as exc:
                        log.warning("KVCoreConnector: load of %s failed: %s", run.req_id, exc)
                got = min(got, read)
            if run.expected_s is not None:  # the decision's estimate, against what it took
                expected += run.expected_s
                cut += (run.num_blocks - got) if was_cut else 0
            nbytes += got * self.io[run.group].layout.block_bytes * len(self.slices)
            failed.extend(run.block_ids[got:])
            if run.group == self._primary.group.index:  # the blocks vLLM counts as restored
                runs += 1
                asked += run.num_blocks
                done += got
            else:  # another group's share, counted apart: load_blocks stays vLLM's count
                kind = self.io[run.group].group.kind
                for name, value in (("load_blocks", run.num_blocks), ("load_done_blocks", got)):
                    other_groups[f"{kind}_{name}"] = other_groups.get(f"{kind}_{name}", 0) + value
        self.counters.add(**other_groups)
        seconds = time.monotonic() - t0
        self.counters.add(
            load_requests=runs,
            load_blocks=asked,
            load_done_blocks=done,
            load_failed_blocks=len(failed),
            load_bytes=nbytes,
            load_seconds=seconds,
        )
        if not cold:
            self.counters.add(load_measured_bytes=nbytes, load_measured_seconds=seconds)
        if expected:
            # paced loads (the scheduler's decision expected them to take ``expected``)
            self.counters.add(
                load_expected_seconds=expected, load_paced_seconds=seconds, load_cut_blocks=cut
            )
        return failed

    def _finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose background loads are all in, and those of them that vLLM must
        recompute whole.

        A block that did not load is reported as such (``get_block_ids_with_load_errors``, in
        the same step's output): vLLM keeps the blocks before the first failed one and
        recomputes from there. A model with several KV cache groups cannot name its failed
        blocks by id alone (vLLM refuses that), so such a request is failed whole.
        """
        with self._lock:
            ready = [
                req
                for req, (_, runs) in self._loading.items()
                if all(f is None or f.done() for _, futures in runs for f in futures)
            ]
            taken = {req: self._loading.pop(req) for req in ready}
            cold = {req for req in ready if req in self._cold_loads}
            self._cold_loads -= cold
        failed: set[str] = set()
        failed_blocks: set[int] = set()
        partial = 0
        for req, (t0, runs) in taken.items():
            missing = self._collect_loads(runs, t0, req in cold)
            if missing:
                partial += 1
                if self._block_errors_name_requests:
                    failed_blocks.update(missing)
                else:
                    failed.add(req)
            self.counters.add(load_async_requests=1, load_wait_seconds=time.monotonic() - t0)
        if partial:
            self.counters.add(load_failed_requests=partial)
        if failed_blocks:
            with self._lock:
                self._load_errors.update(failed_blocks)
        return set(taken), failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._load_errors = self._load_errors, set()
        return failed

    # -- saves -----------------------------------------------------------------------------

    def wait_for_save(self, meta: StepMetadata) -> None:
        if not meta.saves:
            return
        if self._on_gpu:
            # the forward pass was only enqueued: the gathers must see its KV writes
            import torch

            torch.cuda.current_stream().synchronize()
        for run in meta.saves:
            with self._lock:
                self._with_saves.add(run.req_id)  # answered by get_finished like any save
            if not self.writer:  # another TP rank stores these same bytes
                self.counters.add(save_replica_blocks=run.num_blocks)
                continue
            self._save(self._transfer_manager(run.group), run)

    def _save(self, manager: TransferManager | None, run: BlockRun) -> None:
        """Submit the saves of every slice of ``run``'s blocks this rank writes; one answer
        when all are in (:meth:`_save_done`): a block counts as saved when each slice is."""
        futures: list[Future | None] = []
        for piece in self.slices:
            if not piece.writes:
                continue
            fut = None
            if manager is not None:
                task = self._task(run, "save", self.settings.save_timeout_s, piece)
                try:
                    fut = manager.write_back(task)
                except Exception as exc:
                    log.warning("KVCoreConnector: save of %s refused: %s", run.req_id, exc)
            futures.append(fut)
        live = [f for f in futures if f is not None]
        if not live:
            self.counters.add(save_blocks=run.num_blocks, save_failed_blocks=run.num_blocks)
            return
        with self._lock:
            self._inflight.setdefault(run.req_id, set()).update(live)
        submitted = time.monotonic()
        answered: list[Future] = []

        def one_done(fut: Future) -> None:
            with self._lock:
                answered.append(fut)
                last = len(answered) == len(live)
            if last:
                self._save_done(run, futures, submitted)

        for fut in live:
            fut.add_done_callback(one_done)

    def _save_done(self, run: BlockRun, futures: list[Future | None], t0: float) -> None:
        covered = skipped = run.num_blocks
        nbytes = 0
        for fut in futures:
            written_here = skipped_here = 0
            if fut is not None:
                try:
                    result = fut.result()
                    written_here, skipped_here = int(result.num_blocks), int(result.skipped_blocks)
                except Exception as exc:
                    log.warning("KVCoreConnector: save of %s failed: %s", run.req_id, exc)
            covered = min(covered, written_here + skipped_here)
            skipped = min(skipped, skipped_here)
            nbytes += written_here * self.io[run.group].layout.block_bytes
        written = covered - skipped
        counts = {
            "save_blocks": run.num_blocks,
            "save_written_blocks": written,
            "save_skipped_blocks": skipped,
            "save_failed_blocks": run.num_blocks - covered,
        }
        if run.group != self._primary.group.index:  # another group's share, counted apart
            kind = self.io[run.group].group.kind
            counts = {f"{kind}_{name}": value for name, value in counts.items()}
        self.counters.add(**counts, save_bytes=nbytes, save_seconds=time.monotonic() - t0)
        with self._lock:
            pending = self._inflight.get(run.req_id)
            if pending is not None:
                pending.difference_update(f for f in futures if f is not None)
                if not pending:
                    del self._inflight[run.req_id]

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(requests whose blocks vLLM may free now: finished, their saves and loads answered;
        requests whose background loads are in; those of them that failed)."""
        loaded, failed = self._finished_loads()
        with self._lock:
            self._finished.update(r for r in finished_req_ids if r in self._with_saves)
            done = {r for r in self._finished if r not in self._inflight}
            self._finished -= done
            self._with_saves -= done
        return done, loaded, failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, loaded, _ = self.transfer_results(finished_req_ids)
        return (done or None), (loaded or None)

    def handle_preemptions(self, meta: StepMetadata) -> None:
        """vLLM is about to reuse preempted requests' blocks: let their saves finish first."""
        for req_id in meta.preempted:
            with self._lock:
                futures = list(self._inflight.get(req_id, ()))
            for fut in futures:
                with contextlib.suppress(Exception):  # failures are counted by _save_done
                    fut.result()  # answered by its deadline at the latest

    # -- events and stats, shutdown --------------------------------------------------------

    def take_events(self) -> BlockEvents | None:
        """This rank's blocks stored in, or gone from, the store since the last step."""
        self._transfer_manager()  # a backend that opens late starts its stream then
        return self.events.take() if self.events is not None else None

    def take_stats(self) -> dict[str, float]:
        """This step's counters plus the increments of kvcore's own counters."""
        out = self.counters.take()
        manager = self.manager
        if manager is not None:
            for name, snap in (("tm", manager.stats()), ("be", manager.backend.metrics.snapshot())):
                out.update(delta(snap, self._snapshots.get(name, {}), f"kvcore.{name}."))
                self._snapshots[name] = snap
        if self.handle.open_failures:
            before = self._snapshots.setdefault("open", {"failures": 0.0})
            out.update(delta({"failures": self.handle.open_failures}, before, "backend_open_"))
            before["failures"] = float(self.handle.open_failures)
        return out

    def close(self) -> None:
        """Finish queued saves (bounded by their deadlines), stop kvcore's threads, close."""
        if self._closed:
            return
        self._closed = True
        if self.events is not None:
            self.events.close()
        backend_stats: dict[str, float] = {}
        for io in self.io.values():
            manager, io.manager = io.manager, None
            if manager is not None:
                manager.close(timeout_s=self.settings.save_timeout_s)
                backend = manager.backend
                if backend is not None and io is self._primary:
                    backend_stats = {k: v for k, v in backend.stats().items() if v}
            io.handle.close()
        log.info(
            "KVCoreConnector rank %d closed; totals %s; backend %s",
            self.engine_rank,
            json.dumps(self.counters.totals(), sort_keys=True),
            json.dumps(backend_stats, sort_keys=True),
        )

    # -- helpers ---------------------------------------------------------------------------

    def _task(
        self,
        run: BlockRun,
        what: Literal["load", "save"],
        timeout_s: float,
        piece: Slice,
        idle: bool = False,
    ) -> ReadTask | WriteTask:
        """The TransferManager task of one slice of ``run``'s blocks.

        Built without pydantic's validation: this runs on vLLM's step thread, and every field
        comes from the connector itself (keys from vLLM's block hashes, ids from its block
        table, the slice from the plan). The manager still checks the ids against the cache
        and the key count against the longest sequence, as it does for every task.
        """
        mapping = self.io[run.group].mapping
        assert mapping is not None
        fields: dict[str, Any] = {
            "task_id": f"{run.req_id}/{what}/{run.start_block}/g{run.group}/r{piece.rank}",
            "keys": run.keys,
            "device_block_ids": mapping.to_kvcore(run.block_ids, piece.local),
            "start_block": run.start_block,
            "timeout_s": timeout_s,
            "rank": piece.rank,
            "world_size": piece.world,
            "token_ids": run.token_ids,
            "tenant": run.tenant,  # a name settings.tenants validated
        }
        if what == "load":
            return ReadTask.model_construct(
                **fields,
                expected_s=run.expected_s,
                break_even_s=run.break_even_s,
                caller_idle=idle,
            )
        return WriteTask.model_construct(**fields, block_meta=run.block_meta)
