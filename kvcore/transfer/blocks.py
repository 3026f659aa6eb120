"""What a read or a write-back does, from the check at the door to its result.

:class:`BlockTasks` prepares a task once (its request, object names included, built a single
time and then only sliced), runs it (query, write policy, the storage strategy) and accounts
for it. It chooses the storage strategy once, from the backend's capabilities and where the
cache lives, and replaces a host-resident one whose backend broke the fence with staging.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from kvcore.backend import Backend
from kvcore.errors import ConfigError
from kvcore.metrics import Metrics
from kvcore.requests import BlockRequest
from kvcore.runner import HostRunner
from kvcore.tasks import FlushTask, QueryTask, ReadTask, TaskResult, WriteTask
from kvcore.transfer.caches import DeviceCache
from kvcore.transfer.config import TransferConfig
from kvcore.transfer.policy import WritePolicy
from kvcore.transfer.scheduler import Progress, TaskFuture
from kvcore.transfer.storage import (
    BlockJob,
    DirectIO,
    StagedIO,
    StorageIO,
    device_buffers,
    host_resident_buffers,
)

__all__ = ["BlockTasks"]


class BlockTasks:
    """Reads and write-backs of one manager, over one backend."""

    def __init__(
        self, backend: Backend, config: TransferConfig, metrics: Metrics, io: ThreadPoolExecutor
    ) -> None:
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self._io_pool = io
        self._policy = WritePolicy(
            config.write_policy, config.selective_min_hits, config.hit_table_size
        )
        self._storage: StorageIO | None = None
        self._fallback: StorageIO | None = None
        #: lookups, reads and writes run as every engine adapter's do (kvcore's one host
        #: path, on the calling thread); the opened backend keeps and checks block digests
        #: itself where it has no checksums (``verify_blocks``)
        self.runner = HostRunner(backend, name="transfer")

    # -- the storage strategy ------------------------------------------------------------------

    def attach(self, cache: DeviceCache) -> None:
        """Choose the strategy for the first cache; later caches must fit it."""
        if self._storage is None:
            self._storage = self._choose(cache)
        elif self.storage_io == "host_resident" and cache.on_gpu:
            raise ValueError("this manager moves host-resident blocks; the new cache is on a GPU")
        self._storage.attach(cache)

    @property
    def storage_io(self) -> str:
        return self._storage.name if self._storage is not None else "-"

    @property
    def staging_bytes(self) -> int:
        return sum(s.memory_bytes for s in (self._storage, self._fallback) if s is not None)

    def _choose(self, cache: DeviceCache) -> StorageIO:
        backend, cfg = self.backend, self.config
        caps, want = backend.capabilities, cfg.storage_io
        if caps.io == "device":
            if want not in ("auto", "device"):
                raise ConfigError(f"storage_io={want!r}: backend {backend.name!r} does device I/O")
            return DirectIO(backend, cfg, self.runner, "device", device_buffers(cfg.device_id))
        resident = not cache.on_gpu and caps.segmented_host
        if want == "host_resident" and not resident:
            raise ConfigError(
                "storage_io='host_resident' needs a cache in host memory and a backend that "
                f"takes segmented host buffers (backend {backend.name!r}: "
                f"segmented_host={caps.segmented_host}; cache on GPU: {cache.on_gpu})"
            )
        if want == "device":
            raise ConfigError(f"storage_io='device': backend {backend.name!r} does host I/O")
        if resident and want in ("auto", "host_resident"):
            return DirectIO(backend, cfg, self.runner, "host_resident", host_resident_buffers)
        return StagedIO(backend, cfg, self.runner, self._io_pool)

    def _io(self) -> StorageIO:
        """The strategy; a host-resident one whose backend broke the fence is replaced by
        staging for the rest of the manager's life (a device one has no alternative)."""
        storage = self._storage
        assert storage is not None
        if isinstance(storage, DirectIO) and storage.fence_broken and storage.name != "device":
            if self._fallback is None:
                self._fallback = StagedIO(self.backend, self.config, self.runner, self._io_pool)
            return self._fallback
        return storage

    def close(self) -> int:
        """Free the staging not in use; how many buffers stuck calls still hold."""
        return sum(s.close() for s in (self._storage, self._fallback) if s is not None)

    # -- tasks ---------------------------------------------------------------------------------

    def check(self, keys: Sequence[str], start: int, token_ids: Sequence[int] | None) -> None:
        """What a task's blocks must satisfy beyond its own schema."""
        cfg = self.config
        if len(keys) > cfg.max_task_blocks:
            raise ValueError(
                f"keys: {len(keys)} blocks exceed the longest sequence the manager was sized for "
                f"(max_model_len {cfg.max_model_len} = {cfg.max_task_blocks} blocks)"
            )
        if self.backend.capabilities.addressing == "token":
            need = (start + len(keys)) * cfg.layout.block_size
            if token_ids is None or len(token_ids) < need:
                have = 0 if token_ids is None else len(token_ids)
                raise ValueError(
                    f"token_ids: backend {self.backend.name!r} is token-addressed and needs the "
                    f"full path from the root ({need} tokens for blocks up to "
                    f"{start + len(keys)}), got {have}"
                )

    def prepare(self, task: ReadTask | WriteTask, cache: DeviceCache, timeout_s: float) -> BlockJob:
        """Check a read or write task once and build its request once."""
        cache.check_ids(task.device_block_ids, "device_block_ids")
        self.check(task.keys, task.start_block, task.token_ids)
        self._policy.used(task.keys)
        request = self._request(task, timeout_s)
        ids = np.asarray(task.device_block_ids, dtype=np.int64)
        # a read's (ReadTask.expected_s, ReadTask.break_even_s)
        expected = getattr(task, "expected_s", None)
        break_even = getattr(task, "break_even_s", None)
        return BlockJob(request, list(task.device_block_ids), ids, cache, expected, break_even)

    def _request(
        self,
        task: ReadTask | WriteTask | QueryTask | FlushTask,
        timeout_s: float,
        num_blocks: int | None = None,
    ) -> BlockRequest:
        """The task's request, its object names built here, once."""
        return self.backend.request(
            task.task_id,
            task.keys,
            start_block=task.start_block,
            token_ids=task.token_ids,
            timeout_s=timeout_s,
            num_blocks=num_blocks,
            rank=getattr(task, "rank", None),  # a slice other than the context's
            world_size=getattr(task, "world_size", None),
            block_meta=getattr(task, "block_meta", None),
            tenant=getattr(task, "tenant", None),
            caller_idle=getattr(task, "caller_idle", False),  # a read's (ReadTask)
        )

    def query(self, task: QueryTask, timeout_s: float) -> int:
        """Leading blocks of ``task`` stored on this rank, asked synchronously."""
        self.check(task.keys, task.start_block, task.token_ids)
        t0 = time.monotonic()
        n = self.runner.lookup(self._request(task, timeout_s)).outcome
        misses = len(task.keys) - n
        self.metrics.observe("query", time.monotonic() - t0, tasks=1, blocks=len(task.keys),
                             hits=n, misses=misses, errors=int(n.failure is not None))  # fmt: skip
        return int(n)

    def flush_request(self, task: FlushTask, timeout_s: float) -> BlockRequest:
        """A flush's request: the blocks of ``token_ids`` from ``start_block`` (no fake keys)."""
        block_size = self.config.layout.block_size
        n_blocks = max(0, len(task.token_ids) // block_size - task.start_block)
        return self._request(task, timeout_s, num_blocks=n_blocks)

    def flush(
        self, request: BlockRequest, resident: bool, fut: TaskFuture, prog: Progress
    ) -> TaskResult:
        n = self.backend.flush_token_index(request, resident)
        start = request.start_block
        prog.block_ids = list(range(start, start + n))
        if n < request.num_blocks and n.failure is not None:
            prog.stop(n.kind or "backend_error", n.failure)
        self.metrics.add("flush", blocks=n)
        return prog.result(request.task_id, "flush", request.num_blocks, {}, block_ids=[])

    def read(self, job: BlockJob, fut: TaskFuture, prog: Progress) -> TaskResult:
        """Read the task's blocks, asking no query first: the read answers the leading run it
        found (:func:`~kvcore.hookspecs.kvcore_read`), so a block that is gone is a miss of
        this one call. (An engine looked its blocks up before it allocated them; asking again
        here would cost a round trip per read and find the same thing, or a block that may
        still vanish before the read.)"""
        backend, request = self.backend, job.request
        n_req = request.num_blocks
        timings: dict[str, float] = {}
        self._io().read(job, n_req, fut, prog, timings)
        done = len(prog.block_ids)
        failed = int(prog.outcome not in (None, "miss"))
        self.metrics.add(
            "read", blocks=n_req, hits=done, misses=n_req - done, bytes=prog.bytes, errors=failed
        )
        if done and backend.capabilities.token_index and self.config.flush_after_read:
            # the restored blocks now live on the device: tell the index (seed 003)
            t1 = time.monotonic()
            backend.flush_token_index(request.slice(0, done), True)
            timings["flush"] = time.monotonic() - t1
        ok = prog.outcome is None  # restored the whole stored leading run, failing nowhere
        return prog.result(request.task_id, "read", n_req, timings, ok=ok)

    def write(self, job: BlockJob, fut: TaskFuture, prog: Progress) -> TaskResult:
        request = job.request
        timings: dict[str, float] = {}
        t0 = time.monotonic()
        # the write's own check of what is stored is no lookup of the tenant's (its figures
        # count the engine's lookups)
        stored = self.runner.lookup(replace(request, tenant=None)).outcome
        timings["query"] = time.monotonic() - t0
        prog.skipped = stored
        todo = max(0, self._policy.eligible_end(request.block_keys, stored) - stored)
        if todo:
            # the backend's admission, asked before anything is gathered: a refused block
            # costs no copy
            t1 = time.monotonic()
            admitted = int(self.backend.admit(request.slice(stored, stored + todo)))
            timings["admit"] = time.monotonic() - t1
            prog.refused, todo = todo - admitted, admitted
        if todo:
            self._io().write(job, stored, todo, fut, prog, timings)
        written = len(prog.block_ids)
        self.metrics.add(
            "write",
            blocks=request.num_blocks,
            blocks_written=written,
            blocks_skipped=stored,
            blocks_refused=prog.refused,
            bytes=prog.bytes,
            blocks_failed=todo - written,
        )
        ok = written == todo and prog.outcome is None
        return prog.result(request.task_id, "write", todo, timings, ok=ok)
