"""The transfer manager: moves KV blocks device <-> host cache <-> storage backend.

Each operation returns a :class:`~kvcore.transfer.executor.TaskFuture` that resolves to a
:class:`~kvcore.schemas.TaskResult` by the task's deadline at the latest. Three worker pools
(swap, storage read, storage write) keep a slow storage write from delaying a swap; staging
buffers are allocated once, sized for the longest sequence, and reused.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ValidationError

from kvcore import ops
from kvcore.backend import Backend
from kvcore.errors import ConfigError
from kvcore.metrics import Metrics
from kvcore.registry import open_backend
from kvcore.requests import BlockRequest
from kvcore.schemas import (
    BackendContext,
    FlushTask,
    ReadTask,
    SwapTask,
    TaskResult,
    WriteTask,
)
from kvcore.transfer.buffers import DeviceCache, HostCache, StagingBuffer, StagingPool
from kvcore.transfer.config import TransferConfig
from kvcore.transfer.executor import DeadlineWatchdog, QueueFullError, TaskFuture, WorkerPool
from kvcore.transfer.policy import WritePolicy

__all__ = ["TransferManager", "combine_ranks"]

log = logging.getLogger("kvcore.transfer")

_MODE_TO_HOST, _MODE_TO_DEVICE = 0, 1


def combine_ranks(leading_runs: Sequence[int]) -> int:
    """How many leading blocks N tensor-parallel ranks can restore together: the minimum.

    Every rank holds its own slice of each block, so a block is usable only when every rank
    has it. Engines query on every rank, take this minimum, then read that many blocks.
    """
    return min(leading_runs) if leading_runs else 0


class _Progress:
    """What a task completed so far; the deadline answer is built from it."""

    __slots__ = ("block_ids", "bytes", "skipped")

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.bytes = 0
        self.skipped = 0


class TransferManager:
    """Moves blocks between an engine's cache tensors, a host cache and a storage backend.

    :param config: a :class:`TransferConfig` (or a dict of its fields).
    :param cache: the engine's tensors as a :class:`DeviceCache` (None until
        :meth:`restore_caches`).
    :param backend: an opened :class:`~kvcore.Backend`, or a backend name to open with
        ``backend_config`` (the manager then owns and closes it), or None for swaps only.
    """

    def __init__(
        self,
        config: TransferConfig | Mapping[str, Any],
        cache: DeviceCache | None,
        backend: Backend | str | None = None,
        backend_config: BaseModel | Mapping[str, Any] | None = None,
    ) -> None:
        try:
            self.config = TransferConfig.load(config)
        except ValidationError as exc:
            raise ConfigError.from_validation("transfer config", exc) from None
        cfg = self.config
        self.layout = cfg.layout
        self._owns_backend = isinstance(backend, str)
        if isinstance(backend, str):
            context = BackendContext(
                layout=cfg.layout,
                rank=cfg.rank,
                world_size=cfg.world_size,
                device_id=cfg.device_id,
                namespace=cfg.namespace,
            )
            backend = open_backend(backend, backend_config, context=context, strict=cfg.strict)
        elif backend is not None:
            _check_same_engine(cfg, backend)
        self.backend: Backend | None = backend
        self.metrics = Metrics("kvcore_transfer", {"rank": str(cfg.rank)})
        self._cache: DeviceCache | None = None
        self._host: HostCache | None = None
        self._state = threading.Condition()
        self._accepting = True
        self._live: set[TaskFuture] = set()
        self._policy = WritePolicy(cfg.write_policy, cfg.selective_min_hits, cfg.hit_table_size)

        self._watchdog = DeadlineWatchdog()
        self._swap_pool = WorkerPool("swap", cfg.swap_workers, cfg.queue_depth)
        self._read_pool = WorkerPool("read", cfg.read_workers, cfg.queue_depth)
        self._write_pool = WorkerPool("write", cfg.write_workers, cfg.queue_depth)
        # runs backend calls beside the workers, so storage I/O overlaps gathers and scatters
        self._io_pool = ThreadPoolExecutor(
            cfg.read_workers + cfg.write_workers, thread_name_prefix="kvcore-io"
        )
        self._read_staging: StagingPool | None = None
        self._write_staging: StagingPool | None = None
        if self.backend is not None and self.backend.capabilities.io == "host":
            slots = cfg.staging_blocks
            self._read_staging = StagingPool(
                self.layout, slots, cfg.staging_count(cfg.read_workers)
            )
            self._write_staging = StagingPool(
                self.layout, slots, cfg.staging_count(cfg.write_workers)
            )
            for pool in (self._read_staging, self._write_staging):
                for region in pool.regions():
                    self.backend.register_buffer(region.ptr, region.nbytes)
        if cache is not None:
            self.restore_caches(cache)

    # -- public operations -----------------------------------------------------------------

    def swap(self, task: SwapTask | Mapping[str, Any]) -> TaskFuture:
        """Copy (device, host) block pairs to the host cache or back, on the swap pool."""
        task = _validate(SwapTask, task, "swap task")
        op = f"swap_{task.direction}"
        cache, host = self._require_cache(), self._require_host()
        cache.check_ids(task.device_block_ids, "device_block_ids")
        host.check_ids(task.host_block_ids, "host_block_ids")
        return self._submit(
            op,
            task.task_id,
            task.timeout_s,
            self._swap_pool,
            lambda fut, prog: self._do_swap(task, cache, host, fut, prog),
        )

    def read(self, task: ReadTask | Mapping[str, Any]) -> TaskFuture:
        """Restore the stored leading run of ``task.keys`` into ``task.device_block_ids``."""
        return self._submit_blocks(
            "read", _validate(ReadTask, task, "read task"), self._read_pool, self._do_read
        )

    def write_back(self, task: WriteTask | Mapping[str, Any]) -> TaskFuture:
        """Store the blocks of ``task`` the backend lacks (per the write policy)."""
        return self._submit_blocks(
            "write", _validate(WriteTask, task, "write task"), self._write_pool, self._do_write
        )

    def _submit_blocks(
        self, op: str, task: ReadTask, pool: WorkerPool, body: Callable[..., TaskResult]
    ) -> TaskFuture:
        """Check a read or write task against the cache and backend, then queue it."""
        cache = self._require_cache()
        cache.check_ids(task.device_block_ids, "device_block_ids")
        self._check_request(task)
        self._policy.used(task.keys)
        return self._submit(
            op, task.task_id, task.timeout_s, pool, lambda fut, prog: body(task, cache, fut, prog)
        )

    def flush(self, task: FlushTask | Mapping[str, Any]) -> TaskFuture:
        """Update a token-index backend's residency record without moving data (seed 003)."""
        task = _validate(FlushTask, task, "flush task")
        return self._submit(
            "flush",
            task.task_id,
            task.timeout_s,
            self._write_pool,
            lambda fut, prog: self._do_flush(task, fut),
        )

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

    def query(self, task: ReadTask | Mapping[str, Any]) -> int:
        """Leading blocks of ``task`` stored on this rank (synchronous, for schedulers)."""
        task = _validate(ReadTask, task, "query task")
        backend = self._require_backend()
        t0 = time.monotonic()
        n = backend.query(
            self._request(task, task.keys, task.start_block, self._deadline(task.timeout_s))
        )
        self.metrics.observe(
            "query",
            time.monotonic() - t0,
            tasks=1,
            blocks=len(task.keys),
            hits=n,
            misses=len(task.keys) - n,
        )
        return n

    # -- cache lifecycle -------------------------------------------------------------------

    def clear_caches(self, timeout_s: float = 60.0) -> bool:
        """Stop taking tasks, wait for running ones, drop the device and host caches.

        For a weight swap: afterwards the engine may free its cache tensors. Tasks submitted
        until :meth:`restore_caches` fail at once with a clear error. Returns False if running
        tasks did not finish within ``timeout_s`` (the caches are dropped all the same).
        """
        with self._state:
            self._accepting = False
        deadline = time.monotonic() + timeout_s
        drained = all(
            pool.drain(max(0.0, deadline - time.monotonic()))
            for pool in (self._swap_pool, self._read_pool, self._write_pool)
        )
        with self._state:
            live = list(self._live)
        for fut in live:  # answer what still runs: no late scatter into freed tensors
            fut.expire("caches cleared while the task ran")
        with self._state:
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
        with self._state:
            self._cache = cache
            if self.config.num_host_blocks and self._host is None:
                self._host = HostCache(self.layout, self.config.num_host_blocks)
            self._accepting = True
        self.metrics.add("lifecycle", caches_restored=1)

    def _staging_regions(self) -> list[Any]:
        pools = (self._read_staging, self._write_staging)
        return [r for pool in pools if pool is not None for r in pool.regions()]

    @property
    def caches_ready(self) -> bool:
        return self._accepting and self._cache is not None

    def prometheus(self) -> str:
        """Prometheus text of the manager's and the backend's metrics."""
        text = self.metrics.prometheus()
        if self.backend is not None:
            own = {k: v for k, v in self.backend.stats().items() if k.startswith("backend_")}
            text += self.backend.metrics.prometheus(extra=own)
        return text

    def stats(self) -> dict[str, float]:
        return self.metrics.snapshot()

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued tasks (up to ``timeout_s``), stop the threads, free the buffers.

        Never hangs on a stuck backend: tasks still running at ``timeout_s`` are answered,
        and the staging buffers they use are left to be freed when their calls end.
        """
        with self._state:
            self._accepting = False
        deadline = time.monotonic() + timeout_s
        pools = (self._swap_pool, self._read_pool, self._write_pool)
        drained = all([p.drain(max(0.0, deadline - time.monotonic())) for p in pools])
        if not drained:
            with self._state:
                live = list(self._live)
            for fut in live:
                fut.expire("the transfer manager closed while the task ran")
        for p in pools:
            p.shutdown(timeout_s=5.0 if drained else 0.1)
        self._watchdog.stop()
        self._io_pool.shutdown(wait=drained, cancel_futures=not drained)
        unregister = (
            (lambda region: self.backend.unregister_buffer(region.ptr))
            if self.backend is not None
            else (lambda _region: None)
        )
        leaked = sum(
            s.close(unregister) for s in (self._read_staging, self._write_staging) if s is not None
        )
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

    # -- submission --------------------------------------------------------------------------

    def _submit(
        self,
        op: str,
        task_id: str,
        timeout_s: float | None,
        pool: WorkerPool,
        body: Callable[[TaskFuture, _Progress], TaskResult],
    ) -> TaskFuture:
        t_submit = time.monotonic()
        deadline = self._deadline(timeout_s)
        progress = _Progress()

        def on_expire(reason: str | None) -> TaskResult:
            if reason is None:
                self.metrics.add(op, deadline_missed=1)
            return TaskResult(
                task_id=task_id,
                op=op,
                ok=False,
                num_blocks=len(progress.block_ids),
                block_ids=list(progress.block_ids),
                skipped_blocks=progress.skipped,
                bytes=progress.bytes,
                deadline_missed=reason is None,
                error=reason or f"deadline of {deadline - t_submit:.3f}s passed",
                timings_s={"total": time.monotonic() - t_submit},
            )

        fut = TaskFuture(deadline, on_expire)

        def run() -> None:
            t_start = time.monotonic()
            if fut.done():  # expired while queued: do nothing at all
                return
            try:
                result = body(fut, progress)
            except Exception as exc:
                if self.config.strict:
                    fut.fail(exc)
                    return
                log.warning(
                    "kvcore %s task %r failed: %s: %s",
                    op,
                    task_id,
                    type(exc).__name__,
                    exc,
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
                self.metrics.add(op, errors=1)
                result = TaskResult(
                    task_id=task_id,
                    op=op,
                    ok=False,
                    num_blocks=len(progress.block_ids),
                    block_ids=list(progress.block_ids),
                    bytes=progress.bytes,
                    error=f"{type(exc).__name__}: {exc}",
                )
            now = time.monotonic()
            result.timings_s.update(queue=t_start - t_submit, total=now - t_submit)
            if fut.answer(result):
                self.metrics.observe(op, now - t_submit, tasks=1)

        with self._state:
            if not self._accepting:
                return self._rejected(op, task_id, "caches are cleared (restore_caches first)")
            self._live.add(fut)  # clear_caches answers whatever is still live
        fut.add_done_callback(self._forget)
        try:
            pool.submit(run, min(self.config.submit_wait_s, max(0.0, deadline - t_submit)))
        except QueueFullError as exc:
            self.metrics.add(op, rejected=1)
            fut.expire(str(exc))
            return fut
        self._watchdog.watch(fut)
        return fut

    def _forget(self, fut: Future) -> None:
        with self._state:
            self._live.discard(fut)

    def _rejected(self, op: str, task_id: str, why: str) -> TaskFuture:
        self.metrics.add(op, rejected=1)
        fut = TaskFuture(time.monotonic(), lambda _reason: None)
        fut.answer(TaskResult(task_id=task_id, op=op, ok=False, error=why))
        return fut

    # -- workers -----------------------------------------------------------------------------

    def _do_swap(
        self, task: SwapTask, cache: DeviceCache, host: HostCache, fut: TaskFuture, prog: _Progress
    ) -> TaskResult:
        op = f"swap_{task.direction}"
        mode = _MODE_TO_HOST if task.direction == "to_host" else _MODE_TO_DEVICE
        n = len(task.device_block_ids)
        t0 = time.monotonic()
        with fut.unanswered() as live:
            if live:
                for part in self.layout.parts:
                    ops.swap_cache_all_layers(
                        cache.tensors[part],
                        host.buffers[part],
                        host.num_blocks,
                        task.device_block_ids,
                        task.host_block_ids,
                        self.config.device_id,
                        mode,
                    )
                prog.block_ids = list(task.device_block_ids)
                prog.bytes = n * self.layout.block_bytes
        self.metrics.add(op, blocks=n, bytes=prog.bytes)
        return TaskResult(
            task_id=task.task_id,
            op=op,
            num_blocks=len(prog.block_ids),
            block_ids=prog.block_ids,
            bytes=prog.bytes,
            timings_s={"copy": time.monotonic() - t0},
        )

    def _do_read(
        self, task: ReadTask, cache: DeviceCache, fut: TaskFuture, prog: _Progress
    ) -> TaskResult:
        backend = self._require_backend()
        timings: dict[str, float] = {}
        n_req = len(task.keys)
        t0 = time.monotonic()
        stored = backend.query(self._request(task, task.keys, task.start_block, fut.deadline))
        timings["query"] = time.monotonic() - t0
        if backend.capabilities.io == "device":
            self._read_device(task, cache, stored, fut, prog, timings)
        else:
            self._read_host(task, cache, stored, fut, prog, timings)
        done = len(prog.block_ids)
        self.metrics.add("read", blocks=n_req, hits=done, misses=n_req - done, bytes=prog.bytes)
        if done and backend.capabilities.token_index and self.config.flush_after_read:
            # the restored blocks now live on the device: tell the index (seed 003)
            t1 = time.monotonic()
            backend.flush_token_index(
                self._request(task, task.keys[:done], task.start_block, fut.deadline), True
            )
            timings["flush"] = time.monotonic() - t1
        return TaskResult(
            task_id=task.task_id,
            op="read",
            ok=done == stored,
            num_blocks=done,
            block_ids=list(prog.block_ids),
            bytes=prog.bytes,
            timings_s=timings,
        )

    def _read_host(
        self,
        task: ReadTask,
        cache: DeviceCache,
        stored: int,
        fut: TaskFuture,
        prog: _Progress,
        timings: dict[str, float],
    ) -> None:
        """Read span i+1 from the backend while span i is scattered into the device cache."""
        assert self._read_staging is not None
        staging = self._read_staging.acquire(fut.deadline - time.monotonic())
        if staging is None:
            return
        backend = self._require_backend()
        spans = _chunks(stored, self.config.pipeline_blocks)

        def fetch(off: int, size: int) -> tuple[int, float]:
            t0 = time.monotonic()
            request = self._request(
                task,
                task.keys[off : off + size],
                task.start_block + off,
                fut.deadline,
                staging.host_buffers(size, first_slot=off),
            )
            return backend.read(request), time.monotonic() - t0

        pending: Future | None = None
        try:
            pending = self._io_pool.submit(fetch, *spans[0]) if spans else None
            for k, (off, size) in enumerate(spans):
                assert pending is not None
                got, backend_s = pending.result()
                pending = None
                if got == size and k + 1 < len(spans):
                    pending = self._io_pool.submit(fetch, *spans[k + 1])
                t1 = time.monotonic()
                ids = task.device_block_ids[off : off + got]
                with fut.unanswered() as live:
                    if not live:  # the caller was answered: never touch its blocks now
                        return
                    self._stage(cache, staging, ids, _MODE_TO_DEVICE, first_slot=off)
                    prog.block_ids.extend(ids)
                    prog.bytes += got * self.layout.block_bytes
                _add(timings, backend=backend_s, scatter=time.monotonic() - t1)
                if got < size:
                    return
        finally:
            self._release_after(self._read_staging, staging, pending)

    def _read_device(
        self,
        task: ReadTask,
        cache: DeviceCache,
        stored: int,
        fut: TaskFuture,
        prog: _Progress,
        timings: dict[str, float],
    ) -> None:
        if not stored:
            return
        ids = task.device_block_ids[:stored]
        t0 = time.monotonic()
        got = self._require_backend().read(
            self._request(
                task,
                task.keys[:stored],
                task.start_block,
                fut.deadline,
                device=cache.device_buffers(ids, self.config.device_id),
            )
        )
        with fut.unanswered() as live:
            if live:
                prog.block_ids.extend(ids[:got])
                prog.bytes += got * self.layout.block_bytes
        timings["backend"] = time.monotonic() - t0

    def _do_write(
        self, task: WriteTask, cache: DeviceCache, fut: TaskFuture, prog: _Progress
    ) -> TaskResult:
        backend = self._require_backend()
        timings: dict[str, float] = {}
        t0 = time.monotonic()
        stored = backend.query(self._request(task, task.keys, task.start_block, fut.deadline))
        timings["query"] = time.monotonic() - t0
        prog.skipped = stored
        todo = self._policy.eligible_end(task.keys, stored) - stored
        if todo > 0:
            if backend.capabilities.io == "device":
                self._write_device(task, cache, stored, todo, fut, prog, timings)
            else:
                self._write_host(task, cache, stored, todo, fut, prog, timings)
        written = len(prog.block_ids)
        self.metrics.add(
            "write",
            blocks=len(task.keys),
            blocks_written=written,
            blocks_skipped=stored,
            bytes=prog.bytes,
            blocks_failed=todo - written if todo > 0 else 0,
        )
        return TaskResult(
            task_id=task.task_id,
            op="write",
            ok=written == max(todo, 0),
            num_blocks=written,
            block_ids=list(prog.block_ids),
            skipped_blocks=stored,
            bytes=prog.bytes,
            timings_s=timings,
        )

    def _write_host(
        self,
        task: WriteTask,
        cache: DeviceCache,
        first: int,
        todo: int,
        fut: TaskFuture,
        prog: _Progress,
        timings: dict[str, float],
    ) -> None:
        """Gather span i+1 into staging while the backend writes span i."""
        assert self._write_staging is not None
        staging = self._write_staging.acquire(fut.deadline - time.monotonic())
        if staging is None:
            return
        backend = self._require_backend()
        spans = [(first + off, size) for off, size in _chunks(todo, self.config.pipeline_blocks)]

        def gather(lo: int, size: int) -> bool:
            t0 = time.monotonic()
            with fut.unanswered() as live:
                if live:  # once answered, the engine may be reusing these blocks already
                    ids = task.device_block_ids[lo : lo + size]
                    self._stage(cache, staging, ids, _MODE_TO_HOST, first_slot=lo - first)
            _add(timings, gather=time.monotonic() - t0)
            return live

        def store(lo: int, size: int) -> tuple[int, float]:
            t0 = time.monotonic()
            request = self._request(
                task,
                task.keys[lo : lo + size],
                task.start_block + lo,
                fut.deadline,
                staging.host_buffers(size, first_slot=lo - first),
            )
            return backend.write(request), time.monotonic() - t0

        pending: Future | None = None
        try:
            if not spans or not gather(*spans[0]):
                return
            for k, (lo, size) in enumerate(spans):
                pending = self._io_pool.submit(store, lo, size)
                more = k + 1 < len(spans) and gather(*spans[k + 1])
                got, backend_s = pending.result()
                pending = None
                _add(timings, backend=backend_s)
                prog.block_ids.extend(task.device_block_ids[lo : lo + got])
                prog.bytes += got * self.layout.block_bytes
                if got < size or not more:
                    return
        finally:
            self._release_after(self._write_staging, staging, pending)

    @staticmethod
    def _release_after(pool: StagingPool, staging: StagingBuffer, pending: Future | None) -> None:
        """Return ``staging`` to its pool once no backend call still uses it."""
        if pending is None or pending.done():
            pool.release(staging)
        else:  # a call overran: the buffer is returned only when it finally ends
            pending.add_done_callback(lambda _: pool.release(staging))

    def _write_device(
        self,
        task: WriteTask,
        cache: DeviceCache,
        first: int,
        todo: int,
        fut: TaskFuture,
        prog: _Progress,
        timings: dict[str, float],
    ) -> None:
        ids = task.device_block_ids[first : first + todo]
        t0 = time.monotonic()
        got = self._require_backend().write(
            self._request(
                task,
                task.keys[first : first + todo],
                task.start_block + first,
                fut.deadline,
                device=cache.device_buffers(ids, self.config.device_id),
            )
        )
        timings["backend"] = time.monotonic() - t0
        prog.block_ids.extend(ids[:got])
        prog.bytes += got * self.layout.block_bytes

    def _do_flush(self, task: FlushTask, fut: TaskFuture) -> TaskResult:
        backend = self._require_backend()
        n_blocks = len(task.token_ids) // self.layout.block_size - task.start_block
        keys = task.keys or [""] * max(n_blocks, 0)
        request = self._request(task, keys, task.start_block, fut.deadline)
        n = backend.flush_token_index(request, task.resident_on_device)
        self.metrics.add("flush", blocks=n)
        return TaskResult(task_id=task.task_id, op="flush", num_blocks=n)

    # -- helpers -----------------------------------------------------------------------------

    def _stage(
        self,
        cache: DeviceCache,
        staging: StagingBuffer,
        ids: Sequence[int],
        mode: int,
        first_slot: int = 0,
    ) -> None:
        """Gather device blocks into consecutive staging slots (mode 0) or scatter back (1)."""
        if not ids:
            return
        slots = list(range(first_slot, first_slot + len(ids)))
        for part, region in zip(self.layout.parts, staging.regions, strict=True):
            ops.swap_cache_layout(
                cache.tensors[part],
                region,
                cache.block_shape(part),
                ids,
                slots,
                self.config.device_id,
                mode,
            )

    def _request(
        self,
        task: Any,
        keys: Sequence[str],
        start_block: int,
        deadline: float,
        host: Any = None,
        device: Any = None,
    ) -> BlockRequest:
        return self._require_backend().request(
            task.task_id,
            keys,
            start_block=start_block,
            token_ids=task.token_ids,
            deadline=deadline,
            host=host,
            device=device,
        )

    def _check_request(self, task: ReadTask) -> None:
        backend = self._require_backend()
        if len(task.keys) > self.config.staging_blocks:
            raise ValueError(
                f"keys: {len(task.keys)} blocks exceed the longest sequence the manager was "
                f"sized for (max_model_len {self.config.max_model_len} = "
                f"{self.config.staging_blocks} blocks)"
            )
        if backend.capabilities.addressing == "token":
            need = (task.start_block + len(task.keys)) * self.layout.block_size
            if task.token_ids is None or len(task.token_ids) < need:
                have = 0 if task.token_ids is None else len(task.token_ids)
                raise ValueError(
                    f"token_ids: backend {backend.name!r} is token-addressed and needs the full "
                    f"path from the root ({need} tokens for blocks up to "
                    f"{task.start_block + len(task.keys)}), got {have}"
                )

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (
            self.config.default_timeout_s if timeout_s is None else timeout_s
        )

    def _require_backend(self) -> Backend:
        if self.backend is None:
            raise RuntimeError("this TransferManager has no storage backend")
        return self.backend

    def _require_cache(self) -> DeviceCache:
        with self._state:
            cache = self._cache
        if cache is None:
            raise RuntimeError("device caches are cleared: call restore_caches() first")
        return cache

    def _require_host(self) -> HostCache:
        if self._host is None:
            raise RuntimeError("no host cache: set num_host_blocks in the transfer config")
        return self._host


def _check_same_engine(cfg: TransferConfig, backend: Backend) -> None:
    """An already-opened backend must have been opened for this manager's layout and rank:
    its context names the stored objects, so a mismatch would silently miss (or mix ranks)."""
    ctx = backend.context
    for field in ("rank", "world_size", "namespace", "layout"):
        mine, theirs = getattr(cfg, field), getattr(ctx, field)
        if field == "layout" and theirs is None:
            continue
        if mine != theirs:
            raise ConfigError(
                f"invalid transfer config:\n  {field}: {mine!r} differs from the backend's "
                f"context ({theirs!r}); open the backend with the same {field}, or pass its name"
            )


def _chunks(total: int, size: int) -> list[tuple[int, int]]:
    return [(off, min(size, total - off)) for off in range(0, total, size)]


def _add(timings: dict[str, float], **values: float) -> None:
    for k, v in values.items():
        timings[k] = timings.get(k, 0.0) + v


def _validate(model: type[BaseModel], value: Any, what: str) -> Any:
    if isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise ConfigError.from_validation(what, exc) from None
