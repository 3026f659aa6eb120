"""The transfer manager: kvcore's public API for moving KV blocks device <-> host <-> storage.

It validates each task once, at the door, builds its request once (object names included),
and hands it to the :class:`~kvcore.transfer.scheduler.Scheduler` (pools, deadlines, futures)
and to the storage strategy chosen when the manager was built
(:mod:`kvcore.transfer.storage`). Each operation returns a
:class:`~kvcore.transfer.scheduler.TaskFuture` resolving to a :class:`~kvcore.TaskResult` by
the task's deadline at the latest.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError

from kvcore import ops
from kvcore.backend import Backend
from kvcore.errors import ConfigError
from kvcore.handles import BackendHandle
from kvcore.metrics import Metrics
from kvcore.tasks import (
    FlushTask,
    QueryTask,
    ReadTask,
    SwapTask,
    TaskOp,
    TaskResult,
    WriteTask,
)
from kvcore.threads import io_cpus, thread_pool
from kvcore.transfer.blocks import BlockTasks
from kvcore.transfer.caches import DeviceCache, HostCache
from kvcore.transfer.config import TransferConfig
from kvcore.transfer.scheduler import Progress, Scheduler, TaskFuture

__all__ = ["TransferManager", "combine_ranks"]

log = logging.getLogger("kvcore.transfer")

_Model = TypeVar("_Model", bound=BaseModel)


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
        io_cpus()  # a bad KVCORE_IO_CPUS is refused here, naming it, not warned per thread
        self._owns_backend = isinstance(backend, str)
        if isinstance(backend, str):
            backend = BackendHandle(
                backend,
                backend_config,
                context=cfg.context,
                strict=cfg.strict,
                verify_blocks=cfg.verify_blocks,
            ).open()
        elif backend is not None:
            cfg.check_backend(backend)
        self.backend: Backend | None = backend
        self._blocks: BlockTasks | None = None
        self._io_pool: ThreadPoolExecutor | None = None
        self._scheduler: Scheduler | None = None
        self._host: HostCache | None = None
        self._cache: DeviceCache | None = None
        try:
            self.metrics = Metrics("kvcore_transfer", {"rank": str(cfg.rank)})
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
            self._io_pool = thread_pool(
                cfg.read_workers * cfg.pipeline_depth + cfg.write_workers * cfg.pipeline_depth,
                "kvcore-io",
            )
            if backend is not None:
                self._blocks = BlockTasks(backend, cfg, self.metrics, self._io_pool)
            if cache is not None:
                self.restore_caches(cache)
        except BaseException:
            self.close(timeout_s=0)
            raise
        mem = {k: f"{v / 2**20:.1f} MiB" for k, v in self.memory_bytes().items()}
        name = backend.name if backend else "none"
        log.info(
            "kvcore transfer manager: backend %s, storage I/O %s, %s", name, self.storage_io, mem
        )

    # -- public operations -----------------------------------------------------------------

    def swap(self, task: SwapTask | Mapping[str, Any]) -> TaskFuture:
        """Copy (device, host) block pairs to the host cache or back, on the swap pool."""
        task = _validate(SwapTask, task, "swap task")
        cache, host = self._require_cache(), self._require_host()
        cache.check_ids(task.device_block_ids, "device_block_ids")
        host.check_ids(task.host_block_ids, "host_block_ids")
        op: TaskOp = "swap_to_host" if task.direction == "to_host" else "swap_to_device"
        mode = ops.TO_HOST if task.direction == "to_host" else ops.TO_DEVICE
        dev_ids = np.asarray(task.device_block_ids, dtype=np.int64)
        host_ids = np.asarray(task.host_block_ids, dtype=np.int64)

        def body(fut: TaskFuture, prog: Progress) -> TaskResult:
            t0 = time.monotonic()
            with fut.unanswered() as live:
                if live:
                    host.swap(cache, dev_ids, host_ids, self.config.device_id, mode)
                    prog.block_ids = list(task.device_block_ids)
                    prog.bytes = len(dev_ids) * self.layout.block_bytes
            self.metrics.add(op, blocks=len(dev_ids), bytes=prog.bytes)
            return prog.result(task.task_id, op, len(dev_ids), {"copy": time.monotonic() - t0})

        return self._submit(op, task.task_id, task.timeout_s, "swap", body)

    def read(self, task: ReadTask | Mapping[str, Any]) -> TaskFuture:
        """Restore the stored leading run of ``task.keys`` into ``task.device_block_ids``."""
        return self._submit_blocks("read", _validate(ReadTask, task, "read task"))

    def write_back(self, task: WriteTask | Mapping[str, Any]) -> TaskFuture:
        """Store the blocks of ``task`` the backend lacks (per the write policy)."""
        return self._submit_blocks("write", _validate(WriteTask, task, "write task"))

    def query(self, task: QueryTask | Mapping[str, Any]) -> int:
        """Leading blocks of ``task.keys`` stored on this rank (synchronous, for schedulers)."""
        task = _validate(QueryTask, task, "query task")
        return self._require_blocks().query(task, self._timeout(task.timeout_s))

    def flush(self, task: FlushTask | Mapping[str, Any]) -> TaskFuture:
        """Update a token-index backend's residency record without moving data (seed 003)."""
        task = _validate(FlushTask, task, "flush task")
        blocks = self._require_blocks()
        request = blocks.flush_request(task, self._timeout(task.timeout_s))
        body = functools.partial(blocks.flush, request, task.resident_on_device)
        return self._submit("flush", task.task_id, task.timeout_s, "write", body)

    def evicted_from_host(
        self,
        task_id: str,
        token_ids: Sequence[int],
        start_block: int,
        keys: Sequence[str] = (),
        timeout_s: float | None = None,
    ) -> TaskFuture:
        """Tell a token index that blocks from ``start_block`` are no longer resident.

        ``token_ids`` must be the full path from the root: an index locates blocks by it.
        """
        return self.flush(
            FlushTask(
                task_id=task_id,
                token_ids=list(token_ids),
                keys=list(keys),
                start_block=start_block,
                resident_on_device=False,
                timeout_s=timeout_s,
            )
        )

    def set_weight_version(self, version: str) -> None:
        """Scope every task submitted from now on to model weights ``version``.

        Tasks already submitted keep the names they were built with, so KV computed with the
        old weights can never be stored, or read, under the new version.
        """
        self._require_blocks().backend.set_weight_version(version)

    # -- cache lifecycle -------------------------------------------------------------------

    def clear_caches(self, timeout_s: float = 60.0) -> bool:
        """Stop taking tasks, wait for running ones, drop the device and host caches.

        For a weight swap: afterwards the engine may free its cache tensors. Tasks submitted
        until :meth:`restore_caches` are answered at once (``rejected``). Returns False if
        running tasks did not finish within ``timeout_s`` (the caches are dropped all the same,
        after every running task was answered).
        """
        scheduler = self._scheduler_()
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
        if self._blocks is not None:
            self._blocks.attach(cache)
        self._cache = cache
        if self.config.num_host_blocks and self._host is None:
            self._host = HostCache(self.layout, self.config.num_host_blocks)
        self._scheduler_().resume()
        self.metrics.add("lifecycle", caches_restored=1)

    @property
    def caches_ready(self) -> bool:
        return self._cache is not None

    @property
    def storage_io(self) -> str:
        """The storage path chosen: ``staged``, ``host_resident`` or ``device`` (``-``: none)."""
        return self._blocks.storage_io if self._blocks is not None else "-"

    def memory_bytes(self) -> dict[str, int]:
        """Host memory held: staging buffers and the host cache, in bytes."""
        return {
            "staging_bytes": self._blocks.staging_bytes if self._blocks is not None else 0,
            "host_cache_bytes": self._host.nbytes if self._host is not None else 0,
        }

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
        leaked = self._blocks.close() if self._blocks is not None else 0
        if leaked:
            log.warning("kvcore: %d staging buffers still in use by stuck backend calls", leaked)
        if self._host is not None:
            self._host.close()
        if self._owns_backend and self.backend is not None:
            if drained:
                self.backend.close()
            else:  # a stuck call still runs inside it; closing under it could crash the client
                log.warning(
                    "kvcore: backend %r left open: calls are still running", self.backend.name
                )

    def __enter__(self) -> TransferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _submit_blocks(
        self, op: Literal["read", "write"], task: ReadTask | WriteTask
    ) -> TaskFuture:
        blocks = self._require_blocks()
        job = blocks.prepare(task, self._require_cache(), self._timeout(task.timeout_s))
        body = functools.partial(blocks.read if op == "read" else blocks.write, job)
        return self._scheduler_().submit(op, task.task_id, job.request.deadline, op, body)

    def _submit(
        self, op: TaskOp, task_id: str, timeout_s: float | None, lane: str, body: Any
    ) -> TaskFuture:
        deadline = time.monotonic() + self._timeout(timeout_s)
        return self._scheduler_().submit(op, task_id, deadline, lane, body)

    def _timeout(self, timeout_s: float | None) -> float:
        return self._default_timeout_s if timeout_s is None else timeout_s

    def _scheduler_(self) -> Scheduler:
        assert self._scheduler is not None
        return self._scheduler

    def _require_blocks(self) -> BlockTasks:
        if self._blocks is None:
            raise RuntimeError("this TransferManager has no storage backend")
        return self._blocks

    def _require_cache(self) -> DeviceCache:
        cache = self._cache
        if cache is None:
            raise RuntimeError("device caches are cleared: call restore_caches() first")
        return cache

    def _require_host(self) -> HostCache:
        if self._host is None:
            raise RuntimeError("no host cache: set num_host_blocks in the transfer config")
        return self._host


def _validate(model: type[_Model], value: Any, what: str) -> _Model:
    if isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise ConfigError.from_validation(what, exc) from None
