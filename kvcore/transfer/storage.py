"""How blocks travel between the engine's cache and a backend, chosen once per manager.

- :class:`StagedIO`: through host staging buffers, pipelined. A read fetches span *k+1* from
  the backend while span *k* is scattered into the cache; a write gathers span *k+1* while the
  backend stores span *k*. The engine's blocks are touched only by the gathers and scatters,
  each inside :meth:`TaskFuture.unanswered`, so nothing touches them once a task is answered.
- :class:`DirectIO`: one backend call on the engine's own blocks, no copy by kvcore: either
  ``device`` buffers (``io="device"`` backends copy blocks themselves) or, for a cache that lives
  in host memory, segmented host buffers (the backend reads into and writes from the cache blocks
  in place: no staging copy). The call runs inside :meth:`TaskFuture.fenced`, so a deadline
  answer waits for it; a backend that overruns the fence's grace is reported, its late writes
  removed, and (host-resident) the manager falls back to staging for good.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np

from kvcore.backend import Backend
from kvcore.load_pace import LoadPace
from kvcore.ops import TO_DEVICE, TO_HOST, HostBuffer
from kvcore.requests import BlockRequest, DeviceBuffers, HostBuffers, Outcome
from kvcore.runner import HostRunner
from kvcore.transfer.caches import DeviceCache
from kvcore.transfer.config import TransferConfig
from kvcore.transfer.scheduler import Progress, TaskFuture
from kvcore.transfer.staging import StagingBuffer, StagingPool

__all__ = ["BlockJob", "DirectIO", "StagedIO", "StorageIO"]

log = logging.getLogger("kvcore.transfer")


class SpanBuffers(TypedDict, total=False):
    """The buffers a direct call passes to :meth:`BlockRequest.slice`: the engine's own."""

    host: HostBuffers
    device: DeviceBuffers


@dataclass(frozen=True)
class BlockJob:
    """One read or write task, prepared once: its request (object names computed once, sliced
    per span, never rebuilt) and its device block ids."""

    request: BlockRequest
    device_ids: list[int]
    ids: np.ndarray  # the same ids as int64, as the swap ops take them
    cache: DeviceCache
    #: a read's expected time (:attr:`kvcore.ReadTask.expected_s`): read in spans, cut when behind
    expected_s: float | None = None
    #: ...and its break-even time (:attr:`kvcore.ReadTask.break_even_s`): cut when losing
    break_even_s: float | None = None

    def pace(self, blocks: int) -> LoadPace | None:
        """The pace of reading ``blocks`` blocks from now (None: not paced)."""
        if self.expected_s is None or blocks <= 0:
            return None
        return LoadPace(self.expected_s, blocks, time.monotonic(), self.break_even_s)

    def done(self, prog: Progress, lo: int, n: int) -> None:
        """Blocks ``lo .. lo + n - 1`` of the job are complete."""
        prog.block_ids.extend(self.device_ids[lo : lo + n])
        prog.bytes += n * self.cache.layout.block_bytes


def cut_if_behind(
    pace: LoadPace | None,
    prog: Progress,
    done: int,
    total: int,
    last: tuple[int, float] | None = None,
) -> bool:
    """Stop a paced read that fell behind its expected time, in all or in its ``last`` span
    (blocks, seconds), or whose rate says it loses to recomputing (True: stopped)."""
    if pace is None or done >= total:
        return False
    if pace.behind(done, last=last):
        why = f"behind its expected {pace.expected_s:.3f} s"
    elif pace.losing(done):
        why = f"at its rate slower than its break-even {pace.break_even_s:.3f} s"
    else:
        return False
    prog.stop("cut", f"{why} with {done} of {total} blocks read; the rest is recomputed")
    return True


def record_short(prog: Progress, got: Outcome) -> None:
    """A backend call did fewer blocks than asked: a failure if it says so, else a miss."""
    if got.failure is not None:
        prog.stop(got.kind or "backend_error", got.failure)


class StorageIO:
    """Moves a job's blocks between the cache and the backend (one strategy per manager)."""

    name = "?"

    def __init__(self, backend: Backend, config: TransferConfig, runner: HostRunner) -> None:
        self.backend = backend
        self.config = config
        #: what reads and writes go through: kvcore's one host path (on the calling thread;
        #: the opened backend verifies blocks itself). The manager asked admission already
        #: (before gathering), so writes here are not offered again.
        self.runner = runner

    @property
    def memory_bytes(self) -> int:
        """Host memory this strategy holds (staging), in bytes."""
        return 0

    def read(
        self, job: BlockJob, count: int, fut: TaskFuture, prog: Progress, timings: dict[str, float]
    ) -> None:
        """Read the job's first ``count`` blocks; a short backend answer ends the read."""
        raise NotImplementedError

    def write(
        self,
        job: BlockJob,
        first: int,
        todo: int,
        fut: TaskFuture,
        prog: Progress,
        timings: dict[str, float],
    ) -> None:
        raise NotImplementedError

    def attach(self, cache: DeviceCache) -> None:
        """A cache whose blocks this strategy will move (called for every cache)."""

    def close(self) -> int:
        """Free what is not in use; return how many buffers stuck calls still hold."""
        return 0


class StagedIO(StorageIO):
    """Through host staging buffers, pipelined ``pipeline_depth`` spans deep."""

    name = "staged"

    def __init__(
        self,
        backend: Backend,
        config: TransferConfig,
        runner: HostRunner,
        io: ThreadPoolExecutor,
    ) -> None:
        super().__init__(backend, config, runner)
        self._io = io
        self.span = config.span_blocks  # within the staging budget (or ConfigError, first)
        self.depth = config.pipeline_depth
        slots, layout, prefault = config.staging_slots, config.layout, config.prefault_staging
        reads, writes = (
            config.staging_count(w) for w in (config.read_workers, config.write_workers)
        )
        self._read_pool = StagingPool(layout, slots, reads, prefault)
        self._write_pool = StagingPool(layout, slots, writes, prefault)
        for region in self._regions():
            backend.register_buffer(region.ptr, region.nbytes)

    def _regions(self) -> list[HostBuffer]:
        return [*self._read_pool.regions(), *self._write_pool.regions()]

    @property
    def memory_bytes(self) -> int:
        return self._read_pool.nbytes + self._write_pool.nbytes

    def _stage(
        self, job: BlockJob, staging: StagingBuffer, lo: int, n: int, k: int, mode: int
    ) -> None:
        job.cache.copy_to_staging(
            staging.addresses,
            job.ids[lo : lo + n],
            (k % self.depth) * self.span,
            staging.slots,
            self.config.device_id,
            mode,
        )

    def read(
        self, job: BlockJob, count: int, fut: TaskFuture, prog: Progress, timings: dict[str, float]
    ) -> None:
        if not count:
            return
        staging = self._read_pool.acquire(fut.deadline - time.monotonic())
        if staging is None:
            prog.stop("deadline", "no staging buffer came free before the deadline")
            return
        spans = _chunks(count, self.span)
        depth = self.depth

        def fetch(k: int) -> tuple[Outcome, float]:
            off, size = spans[k]
            t0 = time.monotonic()
            host = staging.host_buffers(size, (k % depth) * self.span)
            got = self.runner.read(job.request.slice(off, off + size, host=host)).outcome
            return got, time.monotonic() - t0

        pending: dict[int, Future[tuple[Outcome, float]]] = {}
        try:
            # its blocks' digests (where kept) are read once, not once per span
            with self.backend.reading_in_spans(job.request.slice(0, count)):
                pace = job.pace(count)  # after the digests: see DirectIO.read
                for k in range(min(depth - 1, len(spans))):
                    pending[k] = self._io.submit(fetch, k)
                for k, (off, size) in enumerate(spans):
                    got, backend_s = pending.pop(k).result()
                    _add(timings, backend=backend_s)
                    ahead = k + depth - 1  # its slots were freed by the scatter of span k - 1
                    if got == size and ahead < len(spans):
                        pending[ahead] = self._io.submit(fetch, ahead)
                    t0 = time.monotonic()
                    with fut.unanswered() as live:
                        if not live:  # the caller was answered: never touch its blocks now
                            return
                        self._stage(job, staging, off, got, k, TO_DEVICE)
                        job.done(prog, off, got)
                    _add(timings, scatter=time.monotonic() - t0)
                    if got < size:
                        record_short(prog, got)
                        return
                    if cut_if_behind(pace, prog, off + size, count):
                        return
        finally:
            _release_after(self._read_pool, staging, pending.values())

    def write(
        self,
        job: BlockJob,
        first: int,
        todo: int,
        fut: TaskFuture,
        prog: Progress,
        timings: dict[str, float],
    ) -> None:
        staging = self._write_pool.acquire(fut.deadline - time.monotonic())
        if staging is None:
            prog.stop("deadline", "no staging buffer came free before the deadline")
            return
        spans = [(first + off, size) for off, size in _chunks(todo, self.span)]
        depth = self.depth

        def store(k: int, before: Future[tuple[Outcome, float]] | None) -> tuple[Outcome, float]:
            # one task's stores run in order: a store that fell short ends the run, and a
            # capacity-bound backend sees the blocks in the order they will be counted
            if before is not None and before.result()[0] < spans[k - 1][1]:
                return Outcome(0), 0.0
            lo, size = spans[k]
            t0 = time.monotonic()
            host = staging.host_buffers(size, (k % depth) * self.span)
            got = self.runner.write(
                job.request.slice(lo, lo + size, host=host), admit=False
            ).outcome
            return got, time.monotonic() - t0

        pending: dict[int, Future[tuple[Outcome, float]]] = {}
        counted = 0  # spans whose store result has been taken, in order

        def take_next() -> bool:
            nonlocal counted
            got, backend_s = pending.pop(counted).result()
            _add(timings, backend=backend_s)
            lo, size = spans[counted]
            counted += 1
            job.done(prog, lo, got)
            if got < size:
                record_short(prog, got)
                return False
            return True

        try:
            for k, (lo, size) in enumerate(spans):
                # span k reuses the slots of span k - depth: its store must have ended
                if k >= depth and not take_next():
                    return
                t0 = time.monotonic()
                with fut.unanswered() as live:
                    if not live:  # answered: the engine may be reusing these blocks already
                        return
                    self._stage(job, staging, lo, size, k, TO_HOST)
                _add(timings, gather=time.monotonic() - t0)
                pending[k] = self._io.submit(store, k, pending.get(k - 1))
            while counted < len(spans):
                if not take_next():
                    return
        finally:
            _release_after(self._write_pool, staging, pending.values())

    def close(self) -> int:
        unregister = self.backend.unregister_buffer
        leaked = 0
        for pool in (self._read_pool, self._write_pool):
            leaked += pool.close(lambda region: unregister(region.ptr))
        return leaked


class DirectIO(StorageIO):
    """One backend call on the engine's own blocks, fenced against the deadline answer."""

    def __init__(
        self,
        backend: Backend,
        config: TransferConfig,
        runner: HostRunner,
        name: str,
        buffers: Callable[[DeviceCache, Sequence[int]], SpanBuffers],
    ) -> None:
        super().__init__(backend, config, runner)
        self.name = name
        self._buffers = buffers
        #: set once a backend call outlived a task's answer: the manager stops trusting us
        self.fence_broken = False
        self._registered: list[int] = []

    def attach(self, cache: DeviceCache) -> None:
        """Host-resident: announce the cache's memory to the backend, as staging is announced,
        so a zero-copy client registers it once instead of per call."""
        if self.name != "host_resident":
            return
        for ptr, nbytes in cache.host_regions():
            if ptr not in self._registered:
                self.backend.register_buffer(ptr, nbytes)
                self._registered.append(ptr)

    def close(self) -> int:
        registered, self._registered = self._registered, []
        if not self.fence_broken:  # else a late call may still use them: leave them known
            for ptr in registered:
                self.backend.unregister_buffer(ptr)
        return 0

    def _call(
        self,
        op: str,
        job: BlockJob,
        lo: int,
        n: int,
        fut: TaskFuture,
        prog: Progress,
        timings: dict[str, float],
    ) -> Outcome | None:
        ids = job.device_ids[lo : lo + n]
        request = job.request.slice(lo, lo + n, **self._buffers(job.cache, ids))
        t0 = time.monotonic()
        with fut.fenced() as live:
            if not live:
                return None
            if op == "read":
                got = self.runner.read(request).outcome
            else:
                got = self.runner.write(request, admit=False).outcome
            job.done(prog, lo, got)  # inside the fence: a deadline answer lists these blocks
        _add(timings, backend=time.monotonic() - t0)
        if fut.fence_broken:
            self._late(op, request)
        if got < n:
            record_short(prog, got)
        return got

    def _late(self, op: str, request: BlockRequest) -> None:
        """The task was answered while the backend still used the engine's blocks."""
        self.fence_broken = True
        what = "wrote into" if op == "read" else "read from"
        log.error(
            "kvcore: backend %r %s the engine's blocks after task %r was answered (it overran "
            "its deadline by more than fence_grace_s=%s s); this manager no longer lets it "
            "touch them directly",
            self.backend.name,
            what,
            request.task_id,
            self.config.fence_grace_s,
        )
        if op == "write" and self.backend.implements("kvcore_remove"):
            # what it stored may mix old and new bytes of reused blocks: drop it
            self.runner.remove(request.with_buffers())

    def read(
        self, job: BlockJob, count: int, fut: TaskFuture, prog: Progress, timings: dict[str, float]
    ) -> None:
        if job.expected_s is None:
            if count:
                self._call("read", job, 0, count, fut, prog, timings)
            return
        # paced: spans of ~pace.span_s each at the rate seen so far, each its own call, so a load
        # behind its estimate stops between two of them (a call under way on the engine's
        # blocks is never abandoned). The blocks' digests are read once, first, and the pace
        # starts after them: a fixed cost, not the rate its first spans are judged by
        lo = 0
        with self.backend.reading_in_spans(job.request.slice(0, count)):
            pace = job.pace(count)
            while pace is not None and lo < count:
                n = pace.next_span(lo)
                t0 = time.monotonic()
                got = self._call("read", job, lo, n, fut, prog, timings)
                last = (n, time.monotonic() - t0)
                if got is None or got < n or cut_if_behind(pace, prog, lo + n, count, last):
                    return
                lo += n

    def write(
        self,
        job: BlockJob,
        first: int,
        todo: int,
        fut: TaskFuture,
        prog: Progress,
        timings: dict[str, float],
    ) -> None:
        self._call("write", job, first, todo, fut, prog, timings)


def device_buffers(device_id: int) -> Callable[[DeviceCache, Sequence[int]], SpanBuffers]:
    return lambda cache, ids: {"device": cache.device_buffers(ids, device_id)}


def host_resident_buffers(cache: DeviceCache, ids: Sequence[int]) -> SpanBuffers:
    return {"host": cache.host_buffers(ids)}


def _release_after(
    pool: StagingPool, staging: StagingBuffer, pending: Iterable[Future[Any]]
) -> None:
    """Return ``staging`` to its pool once no backend call still uses it."""
    running = [f for f in pending if not f.done()]
    if not running:
        pool.release(staging)
        return
    left = [len(running)]
    lock = threading.Lock()

    def one_done(_f: Future[Any]) -> None:  # a call overran: release when the last one ends
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            pool.release(staging)

    for f in running:
        f.add_done_callback(one_done)


def _chunks(total: int, size: int) -> list[tuple[int, int]]:
    return [(off, min(size, total - off)) for off in range(0, total, size)]


def _add(timings: dict[str, float], **values: float) -> None:
    for k, v in values.items():
        timings[k] = timings.get(k, 0.0) + v
