"""Task submission: bounded worker pools, futures that resolve by their deadline, the watchdog.

A task's future resolves when its worker finishes *or* when its deadline passes, whichever
comes first: a backend that hangs can stall its worker thread but never the engine waiting on
the future. Two kinds of sections guard the engine's memory once a task has been answered:

- :meth:`TaskFuture.unanswered` (short: a copy into or out of the cache): it and the deadline
  answer exclude each other, so once the caller has the answer no block is touched;
- :meth:`TaskFuture.fenced` (long: a backend call reading into or writing from the engine's own
  blocks): the deadline answer waits for it to end, up to a grace period. A backend honouring its
  deadline ends it in time; one that does not is reported (``fence_broken``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, get_args

from kvcore.metrics import Metrics
from kvcore.requests import FailureKind
from kvcore.tasks import TaskOp, TaskOutcome, TaskResult
from kvcore.threads import QueueFullError, WorkerPool, start_thread

__all__ = [
    "DeadlineWatchdog",
    "Progress",
    "QueueFullError",
    "Scheduler",
    "TaskFuture",
    "WorkerPool",
]

log = logging.getLogger("kvcore.transfer")

_TASK_OUTCOMES = frozenset(get_args(TaskOutcome))

#: The watchdog never sleeps longer than this at once, whatever the deadlines: a bounded wait
#: cannot overflow, and a stopped or repaired heap is noticed within the hour at worst.
_MAX_WAIT_S = 3600.0


@dataclass
class Progress:
    """What a task completed so far; a deadline answer is built from it."""

    block_ids: list[int] = field(default_factory=list)
    bytes: int = 0
    skipped: int = 0
    refused: int = 0  # write: blocks the backend's admission policy did not take
    outcome: TaskOutcome | None = None  # why it stopped short, once known
    error: str | None = None

    def stop(self, outcome: TaskOutcome | FailureKind, error: str | None) -> None:
        """Record why the task stops short (the first reason wins). A reason kvcore does not
        know is recorded as ``error`` (the answer must still be built, or the task would
        never be answered)."""
        if self.outcome is None:
            reason = str(outcome)
            if reason not in _TASK_OUTCOMES:
                reason, error = "error", f"unknown outcome {reason!r}: {error}"
            # reason is one of TaskOutcome's values (checked just above); `in` cannot narrow it
            self.outcome, self.error = reason, error  # type: ignore[assignment]

    def result(
        self,
        task_id: str,
        op: TaskOp,
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
        done = len(self.block_ids)
        outcome = self.outcome or ("complete" if done >= wanted else "miss")
        return TaskResult(
            task_id=task_id,
            op=op,
            outcome=outcome,
            ok=outcome in ("complete", "miss") if ok is None else ok,
            num_blocks=done,
            block_ids=list(self.block_ids) if block_ids is None else block_ids,
            skipped_blocks=self.skipped,
            refused_blocks=self.refused,
            bytes=self.bytes,
            error=self.error,
            timings_s=timings,
        )


class TaskFuture(Future[TaskResult]):
    """A future that answers with a fallback (what completed so far) once its deadline passes."""

    def __init__(
        self,
        deadline: float,
        on_expire: Callable[[str | None, bool], Any],
        fence_grace_s: float = 0.0,
    ) -> None:
        super().__init__()
        self.deadline = deadline
        self._on_expire = on_expire
        self._fence_grace_s = fence_grace_s
        self._lock = threading.Condition(threading.RLock())
        self._fences = 0
        self.fence_broken = False

    @contextmanager
    def unanswered(self) -> Iterator[bool]:
        """Hold off the answer for a short section; yields False if already answered."""
        with self._lock:
            yield not self.done()

    @contextmanager
    def fenced(self) -> Iterator[bool]:
        """A long section touching the engine's blocks; the deadline answer waits for it."""
        with self._lock:
            live = not self.done()
            if live:
                self._fences += 1
        try:
            yield live
        finally:
            if live:
                with self._lock:
                    self._fences -= 1
                    self._lock.notify_all()

    def answer(self, result: Any) -> bool:
        """Resolve with ``result`` unless already answered; False if it was."""
        return self._resolve(self.set_result, result)

    def fail(self, exc: BaseException) -> bool:
        return self._resolve(self.set_exception, exc)

    def _resolve(self, setter: Callable[[Any], None], value: Any) -> bool:
        with self._lock:
            if self.done():
                return False
            setter(value)
            return True

    def expire(self, reason: str | None = None) -> None:
        """Answer now with the fallback (``reason`` None: the deadline passed).

        With a fenced section running, the answer is handed to a short-lived thread that waits
        for the section first, so the caller (the watchdog) never blocks on a backend.
        """
        with self._lock:
            if self.done():
                return
            if self._fences == 0:
                self.set_result(self._on_expire(reason, False))
                return
        start_thread(self._expire_after_fence, "kvcore-fence", args=(reason,))

    def _expire_after_fence(self, reason: str | None) -> None:
        with self._lock:
            self._lock.wait_for(lambda: self._fences == 0 or self.done(), self._fence_grace_s)
            if self.done():
                return
            self.fence_broken = self._fences > 0
            self.set_result(self._on_expire(reason, self.fence_broken))


class DeadlineWatchdog:
    """One thread that expires futures at their deadlines; it cannot die silently.

    An error inside the loop is logged and the loop goes on; if the thread is gone anyway, the
    next :meth:`watch` starts a new one.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, TaskFuture]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = self._start()

    def _start(self) -> threading.Thread:
        return start_thread(self._run, "kvcore-deadlines")

    def watch(self, fut: TaskFuture) -> None:
        with self._cv:
            if not self._thread.is_alive() and not self._stopped:
                log.error("kvcore: the deadline thread had stopped; restarting it")
                self._thread = self._start()
            heapq.heappush(self._heap, (fut.deadline, next(self._seq), fut))
            if self._heap[0][2] is fut:
                self._cv.notify()

    def _run(self) -> None:
        while True:
            try:
                fut = self._next_due()
                if fut is None:
                    return
                if not fut.done():
                    fut.expire()
            except Exception:  # never let one bad answer end deadline enforcement
                log.exception("kvcore: error while expiring a task; deadlines still enforced")

    def _next_due(self) -> TaskFuture | None:
        with self._cv:
            while not self._stopped:
                now = time.monotonic()
                if self._heap and self._heap[0][0] <= now:
                    return heapq.heappop(self._heap)[2]
                wait = min(self._heap[0][0] - now, _MAX_WAIT_S) if self._heap else _MAX_WAIT_S
                self._cv.wait(max(0.0, wait))
            return None

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=5)


Body = Callable[[TaskFuture, Progress], TaskResult]


class Scheduler:
    """Runs task bodies on named worker pools and answers every task by its deadline.

    Owns the pools, the watchdog and the set of live tasks; knows nothing of blocks or
    backends. Results built here (deadline answers, failures, rejections) come from the task's
    :class:`Progress`.
    """

    def __init__(
        self,
        metrics: Metrics,
        lanes: dict[str, int],
        *,
        queue_depth: int,
        submit_wait_s: float,
        fence_grace_s: float,
        strict: bool,
    ) -> None:
        self.metrics = metrics
        self._pools = {name: WorkerPool(name, n, queue_depth) for name, n in lanes.items()}
        self._watchdog = DeadlineWatchdog()
        self._submit_wait_s = submit_wait_s
        self._fence_grace_s = fence_grace_s
        self._strict = strict
        self._state = threading.Lock()
        self._accepting: str | None = None  # None: accepting; else why not
        self._live: set[TaskFuture] = set()

    def submit(
        self, op: TaskOp, task_id: str, deadline: float, lane: str, body: Body
    ) -> TaskFuture:
        """Queue ``body`` on ``lane``; the future resolves by ``deadline`` (+ a fence's grace)."""
        t_submit = time.monotonic()
        progress = Progress()

        def on_expire(reason: str | None, fence_broken: bool) -> TaskResult:
            if reason is None:
                self.metrics.add(op, deadline_missed=1)
            if fence_broken:
                self.metrics.add(op, fence_broken=1)
            outcome: TaskOutcome = "deadline" if reason is None else "rejected"
            error = "the deadline passed" if reason is None else reason
            if fence_broken:
                error += (
                    "; a backend call was still using the engine's blocks "
                    f"{self._fence_grace_s} s later"
                )
            return self._result(task_id, op, progress, outcome, error, deadline_missed=True)

        fut = TaskFuture(deadline, on_expire, self._fence_grace_s)

        def run() -> None:
            t_start = time.monotonic()
            if fut.done():  # answered (deadline) while queued: nothing left worth doing
                return
            try:
                result = body(fut, progress)
            except Exception as exc:
                if self._strict:
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
                result = self._result(
                    task_id, op, progress, "error", f"{type(exc).__name__}: {exc}"
                )
            now = time.monotonic()
            result.timings_s.update(queue=t_start - t_submit, total=now - t_submit)
            if now > deadline:  # answered by the worker, but late (a fence held the deadline)
                result.deadline_missed = True
            if fut.answer(result):
                self.metrics.observe(op, now - t_submit, tasks=1)

        with self._state:
            if self._accepting is not None:
                return self.reject(op, task_id, self._accepting)
            self._live.add(fut)
        fut.add_done_callback(self._forget)
        try:
            wait = min(self._submit_wait_s, max(0.0, deadline - t_submit))
            self._pools[lane].submit(run, wait)
        except QueueFullError as exc:
            self.metrics.add(op, rejected=1)
            fut.expire(str(exc))
            return fut
        self._watchdog.watch(fut)
        return fut

    @staticmethod
    def _result(
        task_id: str,
        op: TaskOp,
        progress: Progress,
        outcome: TaskOutcome,
        error: str | None,
        deadline_missed: bool = False,
    ) -> TaskResult:
        """An answer the scheduler gives for the worker: what completed, and why it stopped."""
        result = progress.result(task_id, op, 0, {}, ok=False)
        result.outcome, result.error, result.deadline_missed = outcome, error, deadline_missed
        return result

    def reject(self, op: TaskOp, task_id: str, why: str) -> TaskFuture:
        """An already answered future saying the task was not run."""
        self.metrics.add(op, rejected=1)
        fut = TaskFuture(time.monotonic(), lambda _reason, _fence: None)
        fut.answer(TaskResult(task_id=task_id, op=op, outcome="rejected", ok=False, error=why))
        return fut

    def _forget(self, fut: Future[TaskResult]) -> None:
        with self._state:
            self._live.discard(fut)

    def pause(self, why: str) -> None:
        """Answer new submissions at once with ``rejected`` (``why``) until :meth:`resume`."""
        with self._state:
            self._accepting = why

    def resume(self) -> None:
        with self._state:
            self._accepting = None

    def drain(self, timeout_s: float) -> bool:
        """Wait for every queued and running task; False if some still run at ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        return all([p.drain(max(0.0, deadline - time.monotonic())) for p in self._pools.values()])

    def answer_live(self, reason: str) -> None:
        """Answer every task still running (they touch nothing of the engine's afterwards)."""
        with self._state:
            live = list(self._live)
        for fut in live:
            fut.expire(reason)

    def close(self, drained: bool) -> None:
        for pool in self._pools.values():
            pool.shutdown(timeout_s=5.0 if drained else 0.1)
        self._watchdog.stop()
