"""Worker pools with bounded queues, and futures that resolve by their deadline.

A task's future resolves when its worker finishes *or* when its deadline passes, whichever
comes first: a backend that hangs can stall its worker thread but never the engine waiting
on the future. Work that must not happen after the caller was answered (scattering blocks
into device memory the engine may have reused) runs inside :meth:`TaskFuture.unanswered`,
which excludes the deadline expiry.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

__all__ = ["DeadlineWatchdog", "QueueFullError", "TaskFuture", "WorkerPool"]

log = logging.getLogger("kvcore.transfer")


class QueueFullError(RuntimeError):
    """The pool's queue stayed full for the whole wait (back-pressure)."""


class TaskFuture(Future):
    """A future that answers with a fallback (what completed so far) once its deadline passes.

    Workers do every step that has engine-visible effects inside ``with fut.unanswered() as
    live: if live: ...``: that block and the deadline expiry exclude each other, so once the
    caller has been answered no further block is scattered into device memory.
    """

    def __init__(self, deadline: float, on_expire: Callable[[str | None], Any]) -> None:
        super().__init__()
        self.deadline = deadline
        self._on_expire = on_expire
        self._lock = threading.RLock()

    @contextmanager
    def unanswered(self) -> Iterator[bool]:
        with self._lock:
            yield not self.done()

    def answer(self, result: Any) -> bool:
        """Resolve with ``result`` unless already answered; False if it was."""
        with self._lock:
            if self.done():
                return False
            self.set_result(result)
            return True

    def fail(self, exc: BaseException) -> bool:
        with self._lock:
            if self.done():
                return False
            self.set_exception(exc)
            return True

    def expire(self, reason: str | None = None) -> None:
        """Answer now with the fallback (``reason`` None: the deadline passed)."""
        with self._lock:
            if not self.done():
                self.set_result(self._on_expire(reason))


class DeadlineWatchdog:
    """One thread that expires futures at their deadlines."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, TaskFuture]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvcore-deadlines", daemon=True)
        self._thread.start()

    def watch(self, fut: TaskFuture) -> None:
        with self._cv:
            heapq.heappush(self._heap, (fut.deadline, next(self._seq), fut))
            if self._heap[0][2] is fut:
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    if self._heap:
                        self._cv.wait(max(0.0, self._heap[0][0] - time.monotonic()))
                    else:
                        self._cv.wait()
                if self._stopped:
                    return
                _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                fut.expire()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=5)


_STOP = object()


class WorkerPool:
    """A fixed set of threads fed by a bounded queue.

    ``submit`` waits up to ``wait_s`` for room in the queue and then raises
    :class:`QueueFullError`: the engine decides what a rejected task means (a miss).
    """

    def __init__(self, name: str, workers: int, queue_depth: int) -> None:
        self.name = name
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_depth)
        self._threads = [
            threading.Thread(target=self._run, name=f"kvcore-{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        self._inflight = 0
        self._idle = threading.Condition()
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], None], wait_s: float) -> None:
        with self._idle:
            self._inflight += 1
        try:
            self._queue.put(fn, block=wait_s > 0, timeout=wait_s if wait_s > 0 else None)
        except queue.Full:
            self._done_one()
            raise QueueFullError(
                f"{self.name} queue is full ({self._queue.maxsize} tasks)"
            ) from None

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is _STOP:
                return
            try:
                fn()
            except BaseException:  # a task's own error handling failed: keep the worker alive
                log.exception("kvcore %s worker: unhandled error", self.name)
            finally:
                self._done_one()

    def _done_one(self) -> None:
        with self._idle:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.notify_all()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted task has finished; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        for _ in self._threads:
            try:
                self._queue.put(_STOP, timeout=timeout_s)
            except queue.Full:
                break
        for t in self._threads:
            t.join(timeout=timeout_s)
