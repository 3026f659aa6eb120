"""The transfer manager: kvcore's public API for moving KV blocks device <-> host <-> storage.

It validates each task once, at the door, builds its request once (object names included),
and hands it to the :class:`~kvcore.transfer.scheduler.Scheduler` (pools, deadlines, futures)
and to the storage strategy chosen when the manager was built
(:mod:`kvcore.transfer.storage`). Each operation returns a
:class:`~kvcore.transfer.scheduler.TaskFuture` resolving to a :class:`~kvcore.TaskResult` by
the task's deadline at the latest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError

from kvcore import ops
from kvcore.backend import Backend
from kvcore.errors import ConfigError
from kvcore.metrics import Metrics
from kvcore.registry import open_backend
from kvcore.schemas import FlushTask, QueryTask, ReadTask, SwapTask, TaskResult, WriteTask
from kvcore.transfer.caches import DeviceCache, HostCache
from kvcore.transfer.config import TransferConfig
from kvcore.transfer.policy import WritePolicy
from kvcore.transfer.scheduler import Progress, Scheduler, TaskFuture
from kvcore.transfer.storage import (
    BlockJob,
    DirectIO,
    StagedIO,
    StorageIO,
    device_buffers,
    host_resident_buffers,
)

__all__ = ["TransferManager", "combine_ranks"]

log = logging.getLogger("kvcore.transfer")


def combine_ranks(leading_runs: Sequence[int]) -> int:
    """How many leading blocks N tensor-parallel ranks can restore together: the minimum.

    Every rank holds its own slice of each block, so a block is usable only when every rank
    has it. Engines query on every rank, take this minimum, then read that many blocks.
    """
    return min(leading_runs) if leading_runs else 0


class TransferManager:
    """Moves blocks between an engine's cache tensors, a host cache and a storage backend.

    :param config: a :class:`TransferConfig` (or a dict of its fields).
    :param cache: the engine's tensors as a :class:`DeviceCache` (None until
        :meth:`restore_caches`).
    :param backend: an opened :class:`~kvcore.Backend`, or a backend name to open with
        ``backend_config`` (the manager then owns and closes it), or None for swaps only.
    :raises ConfigError: a config, or an opened backend's context, that does not fit. A failed
        construction leaves nothing running and closes a backend it opened.
    """

    def __init__(
        self,
        config: TransferConfig | Mapping[str, Any],
        cache: DeviceCache | None,
        backend: Backend | str | None = None,
        backend_config: BaseModel | Mapping[str, Any] | str | None = None,
    ) -> None:
        try:  # a model or a dict: environment overrides apply to both
            self.config = cfg = TransferConfig.load(config)
        except ValidationError as exc:
            raise ConfigError.from_validation("transfer config", exc) from None
        self.layout = cfg.layout
        self._owns_backend = isinstance(backend, str)
        if isinstance(backend, str):
            backend = open_backend(backend, backend_config, context=cfg.context, strict=cfg.strict)
        elif backend is not None:
            _check_same_engine(cfg, backend)
        self.backend: Backend | None = backend
        self._storage: StorageIO | None = None
        self._staged_fallback: StorageIO | None = None
        self._io_pool: ThreadPoolExecutor | None = None
        self._scheduler: Scheduler | None = None
        self._host: HostCache | None = None
        self._cache: DeviceCache | None = None
        try:
            self.metrics = Metrics("kvcore_transfer", {"rank": str(cfg.rank)})
            self._policy = WritePolicy(cfg.write_policy, cfg.selective_min_hits, cfg.hit_table_size)
            self._default_timeout_s = cfg.default_timeout_s or (
                backend.config.default_timeout_s if backend is not None else 5.0
            )
            self._scheduler = Scheduler(
                self.metrics,
                {"swap": cfg.swap_workers, "read": cfg.read_workers, "write": cfg.write_workers},
                queue_depth=cfg.queue_depth,
                submit_wait_s=cfg.submit_wait_s,
                fence_grace_s=cfg.fence_grace_s,
                strict=cfg.strict,
            )
            # backend calls run here, beside the workers, so storage I/O overlaps device copies
            self._io_pool = ThreadPoolExecutor(
                cfg.read_workers * cfg.pipeline_depth + cfg.write_workers * cfg.pipeline_depth,
                thread_name_prefix="kvcore-io",
            )
            if cache is not None:
                self.restore_caches(cache)
        except BaseException:
            self.close(timeout_s=0)
            raise
        log.info(
            "kvcore transfer manager: backend %s, storage I/O %s, staging %.1f MiB, host cache "
            "%.1f MiB",
            backend.name if backend is not None else "none",
            self._storage.name if self._storage is not None else "-",
            self.memory_bytes()["staging_bytes"] / 2**20,
            self.memory_bytes()["host_cache_bytes"] / 2**20,
        )

    # -- public operations -----------------------------------------------------------------

    def swap(self, task: SwapTask | Mapping[str, Any]) -> TaskFuture:
        """Copy (device, host) block pairs to the host cache or back, on the swap pool."""
        task = _validate(SwapTask, task, "swap task")
        cache, host = self._require_cache(), self._require_host()
        cache.check_ids(task.device_block_ids, "device_block_ids")
        host.check_ids(task.host_block_ids, "host_block_ids")
        op = f"swap_{task.direction}"
        mode = ops.TO_HOST if task.direction == "to_host" else ops.TO_DEVICE
        dev_ids = np.asarray(task.device_block_ids, dtype=np.int64)
        host_ids = np.asarray(task.host_block_ids, dtype=np.int64)

        def body(fut: TaskFuture, prog: Progress) -> TaskResult:
            t0 = time.monotonic()
            with fut.unanswered() as live:
                if live:
                    for part in self.layout.parts:
                        ops.copy_pairs(cache.layers[part], host.ptrs[part], host.num_blocks,
                                       dev_ids, host_ids, self.config.device_id, mode)  # fmt: skip
                    prog.block_ids = list(task.device_block_ids)
                    prog.bytes = len(dev_ids) * self.layout.block_bytes
            self.metrics.add(op, blocks=len(dev_ids), bytes=prog.bytes)
            return _result(task.task_id, op, prog, len(dev_ids), {"copy": time.monotonic() - t0})

        return self._submit(op, task.task_id, task.timeout_s, "swap", body)

    def read(self, task: ReadTask | Mapping[str, Any]) -> TaskFuture:
        """Restore the stored leading run of ``task.keys`` into ``task.device_block_ids``."""
        task = _validate(ReadTask, task, "read task")
        job = self._job(task)
        return self._submit("read", task.task_id, task.timeout_s, "read",
                            lambda fut, prog: self._do_read(job, fut, prog), job)  # fmt: skip

    def write_back(self, task: WriteTask | Mapping[str, Any]) -> TaskFuture:
        """Store the blocks of ``task`` the backend lacks (per the write policy)."""
        task = _validate(WriteTask, task, "write task")
        job = self._job(task)
        return self._submit("write", task.task_id, task.timeout_s, "write",
                            lambda fut, prog: self._do_write(job, fut, prog), job)  # fmt: skip

    def query(self, task: QueryTask | Mapping[str, Any]) -> int:
        """Leading blocks of ``task.keys`` stored on this rank (synchronous, for schedulers)."""
        task = _validate(QueryTask, task, "query task")
        backend = self._require_backend()
        self._check_blocks(task.keys, task.start_block, task.token_ids)
        t0 = time.monotonic()
        n = backend.query(
            backend.request(task.task_id, task.keys, start_block=task.start_block,
                            token_ids=task.token_ids, timeout_s=self._timeout(task.timeout_s))
        )  # fmt: skip
        misses = len(task.keys) - n
        self.metrics.observe("query", time.monotonic() - t0, tasks=1, blocks=len(task.keys),
                             hits=n, misses=misses, errors=int(n.failure is not None))  # fmt: skip
        return int(n)

    def flush(self, task: FlushTask | Mapping[str, Any]) -> TaskFuture:
        """Update a token-index backend's residency record without moving data (seed 003)."""
        task = _validate(FlushTask, task, "flush task")
        backend = self._require_backend()
        n_blocks = max(0, len(task.token_ids) // self.layout.block_size - task.start_block)
        request = backend.request(task.task_id, task.keys, start_block=task.start_block,
                                  token_ids=task.token_ids, timeout_s=self._timeout(task.timeout_s),
                                  num_blocks=n_blocks)  # fmt: skip

        def body(fut: TaskFuture, prog: Progress) -> TaskResult:
            n = backend.flush_token_index(request, task.resident_on_device)
            prog.block_ids = list(range(task.start_block, task.start_block + n))
            if n < n_blocks and n.failure is not None:
                prog.stop(n.kind or "backend_error", n.failure)  # type: ignore[arg-type]
            self.metrics.add("flush", blocks=n)
            return _result(task.task_id, "flush", prog, n_blocks, {}, block_ids=[])

        return self._submit("flush", task.task_id, task.timeout_s, "write", body)

    def evicted_from_host(self, task_id: str, token_ids: Sequence[int], start_block: int,
                          keys: Sequence[str] = (), timeout_s: float | None = None) -> TaskFuture:  # fmt: skip
        """Tell a token index that blocks from ``start_block`` are no longer resident.

        ``token_ids`` must be the full path from the root: an index locates blocks by it.
        """
        return self.flush(FlushTask(task_id=task_id, token_ids=list(token_ids), keys=list(keys),
                                    start_block=start_block, resident_on_device=False,
                                    timeout_s=timeout_s))  # fmt: skip

    def set_weight_version(self, version: str) -> None:
        """Scope every task submitted from now on to model weights ``version``.

        Tasks already submitted keep the names they were built with, so KV computed with the
        old weights can never be stored, or read, under the new version.
        """
        self._require_backend().set_weight_version(version)

    # -- cache lifecycle -------------------------------------------------------------------

    def clear_caches(self, timeout_s: float = 60.0) -> bool:
        """Stop taking tasks, wait for running ones, drop the device and host caches.

        For a weight swap: afterwards the engine may free its cache tensors. Tasks submitted
        until :meth:`restore_caches` are answered at once (``rejected``). Returns False if
        running tasks did not finish within ``timeout_s`` (the caches are dropped all the same,
        after every running task was answered).
        """
        scheduler = self._require_scheduler()
        scheduler.pause("caches are cleared (restore_caches first)")
        drained = scheduler.drain(timeout_s)
        scheduler.answer_live("caches cleared while the task ran")
        self._cache = None
        if self._host is not None:
            self._host.close()
            self._host = None
        self.metrics.add("lifecycle", caches_cleared=1)
        return drained

    def restore_caches(self, cache: DeviceCache) -> None:
        """Attach (new) cache tensors and reallocate the host cache; accept tasks again."""
        if cache.layout != self.layout:
            raise ValueError("the cache's layout differs from the manager's layout")
        if self._storage is None and self.backend is not None:
            self._storage = self._choose_storage(cache)
        elif self.storage_io == "host_resident" and cache.on_gpu:
            raise ValueError("this manager moves host-resident blocks; the new cache is on a GPU")
        self._cache = cache
        if self.config.num_host_blocks and self._host is None:
            self._host = HostCache(self.layout, self.config.num_host_blocks)
        self._require_scheduler().resume()
        self.metrics.add("lifecycle", caches_restored=1)

    @property
    def caches_ready(self) -> bool:
        return self._cache is not None

    @property
    def storage_io(self) -> str:
        """The storage path chosen: ``staged``, ``host_resident`` or ``device`` (``-`` if none)."""
        return self._storage.name if self._storage is not None else "-"

    def memory_bytes(self) -> dict[str, int]:
        """Host memory held: staging buffers and the host cache, in bytes."""
        staging = sum(s.memory_bytes for s in (self._storage, self._staged_fallback) if s)
        return {"staging_bytes": staging,
                "host_cache_bytes": self._host.nbytes if self._host is not None else 0}  # fmt: skip

    def prometheus(self) -> str:
        """Prometheus text of the manager's and the backend's metrics."""
        text = self.metrics.prometheus(extra=self.memory_bytes())
        if self.backend is not None:
            own = {k: v for k, v in self.backend.stats().items() if k.startswith("backend_")}
            text += self.backend.metrics.prometheus(extra=own)
        return text

    def stats(self) -> dict[str, float]:
        return {**self.metrics.snapshot(), **self.memory_bytes()}

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued tasks (up to ``timeout_s``), stop the threads, free the buffers.

        Never hangs on a stuck backend: tasks still running at ``timeout_s`` are answered,
        and the staging buffers they use are left to be freed when their calls end.
        """
        drained = True
        if self._scheduler is not None:
            self._scheduler.pause("the transfer manager is closed")
            drained = self._scheduler.drain(timeout_s)
            if not drained:
                self._scheduler.answer_live("the transfer manager closed while the task ran")
            self._scheduler.close(drained)
        if self._io_pool is not None:
            self._io_pool.shutdown(wait=drained, cancel_futures=not drained)
        leaked = sum(s.close() for s in (self._storage, self._staged_fallback) if s is not None)
        if leaked:
            log.warning("kvcore: %d staging buffers still in use by stuck backend calls", leaked)
        if self._host is not None:
            self._host.close()
        if self._owns_backend and self.backend is not None:
            if drained:
                self.backend.close()
            else:  # a stuck call still runs inside it; closing under it could crash the client
                log.warning("kvcore: backend %r left open: calls are still running",
                            self.backend.name)  # fmt: skip

    def __enter__(self) -> TransferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _choose_storage(self, cache: DeviceCache) -> StorageIO:
        backend, cfg = self._require_backend(), self.config
        caps, want = backend.capabilities, cfg.storage_io
        if caps.io == "device":
            if want not in ("auto", "device"):
                raise ConfigError(f"storage_io={want!r}: backend {backend.name!r} does device I/O")
            return DirectIO(backend, cfg, "device", device_buffers(cfg.device_id))
        resident = not cache.on_gpu and caps.segmented_host
        if want == "host_resident" and not resident:
            raise ConfigError(
                "storage_io='host_resident' needs a cache in host memory and a backend that "
                f"takes segmented host buffers (backend {backend.name!r}: "
                f"segmented_host={caps.segmented_host}; cache on GPU: {cache.on_gpu})"
            )
        if resident and want in ("auto", "host_resident"):
            return DirectIO(backend, cfg, "host_resident", host_resident_buffers)
        assert self._io_pool is not None
        return StagedIO(backend, cfg, self._io_pool)

    def _io(self) -> StorageIO:
        """The strategy; a host-resident one whose backend broke the fence is replaced by
        staging for the rest of the manager's life."""
        storage = self._storage
        assert storage is not None
        if isinstance(storage, DirectIO) and storage.fence_broken and storage.name != "device":
            if self._staged_fallback is None:
                assert self._io_pool is not None
                self._staged_fallback = StagedIO(storage.backend, self.config, self._io_pool)
            return self._staged_fallback
        return storage

    def _job(self, task: ReadTask | WriteTask) -> BlockJob:
        """Check a read or write task against the cache and backend; build its request once."""
        cache, backend = self._require_cache(), self._require_backend()
        cache.check_ids(task.device_block_ids, "device_block_ids")
        self._check_blocks(task.keys, task.start_block, task.token_ids)
        self._policy.used(task.keys)
        request = backend.request(task.task_id, task.keys, start_block=task.start_block,
                                  token_ids=task.token_ids, timeout_s=self._timeout(task.timeout_s))  # fmt: skip
        ids = np.asarray(task.device_block_ids, dtype=np.int64)
        return BlockJob(request, list(task.device_block_ids), ids, cache)

    def _check_blocks(self, keys: Sequence[str], start: int, token_ids: Sequence[int] | None) -> None:  # fmt: skip
        backend = self._require_backend()
        if len(keys) > self.config.max_task_blocks:
            raise ValueError(
                f"keys: {len(keys)} blocks exceed the longest sequence the manager was sized for "
                f"(max_model_len {self.config.max_model_len} = {self.config.max_task_blocks} "
                "blocks)"
            )
        if backend.capabilities.addressing == "token":
            need = (start + len(keys)) * self.layout.block_size
            if token_ids is None or len(token_ids) < need:
                have = 0 if token_ids is None else len(token_ids)
                raise ValueError(
                    f"token_ids: backend {backend.name!r} is token-addressed and needs the full "
                    f"path from the root ({need} tokens for blocks up to {start + len(keys)}), "
                    f"got {have}"
                )

    def _do_read(self, job: BlockJob, fut: TaskFuture, prog: Progress) -> TaskResult:
        backend, request = self._require_backend(), job.request
        n_req, timings = request.num_blocks, {}
        t0 = time.monotonic()
        stored = backend.query(request)
        timings["query"] = time.monotonic() - t0
        if stored < n_req and stored.failure is not None:
            prog.stop(stored.kind or "backend_error", stored.failure)  # type: ignore[arg-type]
        self._io().read(job, stored, fut, prog, timings)
        done = len(prog.block_ids)
        self.metrics.add("read", blocks=n_req, hits=done, misses=n_req - done, bytes=prog.bytes,
                         errors=int(prog.outcome not in (None, "miss")))  # fmt: skip
        if done and backend.capabilities.token_index and self.config.flush_after_read:
            # the restored blocks now live on the device: tell the index (seed 003)
            t1 = time.monotonic()
            backend.flush_token_index(request.slice(0, done), True)
            timings["flush"] = time.monotonic() - t1
        ok = done == stored and prog.outcome is None  # restored all the query found
        return _result(request.task_id, "read", prog, n_req, timings, ok=ok)

    def _do_write(self, job: BlockJob, fut: TaskFuture, prog: Progress) -> TaskResult:
        backend, request = self._require_backend(), job.request
        timings: dict[str, float] = {}
        t0 = time.monotonic()
        stored = backend.query(request)
        timings["query"] = time.monotonic() - t0
        prog.skipped = stored
        todo = self._policy.eligible_end(request.block_keys, stored) - stored
        if todo > 0:
            self._io().write(job, stored, todo, fut, prog, timings)
        written = len(prog.block_ids)
        self.metrics.add("write", blocks=request.num_blocks, blocks_written=written,
                         blocks_skipped=stored, bytes=prog.bytes,
                         blocks_failed=max(todo, 0) - written)  # fmt: skip
        ok = written == max(todo, 0) and prog.outcome is None
        return _result(request.task_id, "write", prog, max(todo, 0), timings, ok=ok)

    def _submit(self, op: str, task_id: str, timeout_s: float | None, lane: str, body: Any,
                job: BlockJob | None = None) -> TaskFuture:  # fmt: skip
        deadline = job.request.deadline if job else time.monotonic() + self._timeout(timeout_s)
        return self._require_scheduler().submit(op, task_id, deadline, lane, body)

    def _timeout(self, timeout_s: float | None) -> float:
        return self._default_timeout_s if timeout_s is None else timeout_s

    def _require_scheduler(self) -> Scheduler:
        assert self._scheduler is not None
        return self._scheduler

    def _require_backend(self) -> Backend:
        if self.backend is None:
            raise RuntimeError("this TransferManager has no storage backend")
        return self.backend

    def _require_cache(self) -> DeviceCache:
        cache = self._cache
        if cache is None:
            raise RuntimeError("device caches are cleared: call restore_caches() first")
        return cache

    def _require_host(self) -> HostCache:
        if self._host is None:
            raise RuntimeError("no host cache: set num_host_blocks in the transfer config")
        return self._host


def _result(
    task_id: str,
    op: str,
    prog: Progress,
    wanted: int,
    timings: dict[str, float],
    *,
    ok: bool | None = None,
    block_ids: list[int] | None = None,
) -> TaskResult:
    """The worker's answer: complete, a miss (short, nothing failed) or why it failed.

    ``ok`` (default: nothing failed) keeps its 0.1 meaning for reads and writes: every block
    the query found was restored, or every block attempted was stored.
    """
    done = len(prog.block_ids)
    outcome = prog.outcome or ("complete" if done >= wanted else "miss")
    return TaskResult(
        task_id=task_id,
        op=op,
        outcome=outcome,
        ok=outcome in ("complete", "miss") if ok is None else ok,
        num_blocks=done,
        block_ids=list(prog.block_ids) if block_ids is None else block_ids,
        skipped_blocks=prog.skipped,
        bytes=prog.bytes,
        error=prog.error,
        timings_s=timings,
    )


def _check_same_engine(cfg: TransferConfig, backend: Backend) -> None:
    """An already-opened backend must have been opened for this manager's layout and rank:
    its context names the stored objects, so a mismatch would silently miss (or mix ranks)."""
    mine, theirs = cfg.context, backend.context
    for field in ("rank", "world_size", "namespace", "layout"):
        if field == "layout" and theirs.layout is None:
            continue
        if getattr(mine, field) != getattr(theirs, field):
            raise ConfigError(
                f"invalid transfer config:\n  {field}: {getattr(mine, field)!r} differs from the "
                f"backend's context ({getattr(theirs, field)!r}); open the backend with the same "
                f"{field}, or pass its name"
            )


def _validate(model: type[BaseModel], value: Any, what: str) -> Any:
    if isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise ConfigError.from_validation(what, exc) from None
