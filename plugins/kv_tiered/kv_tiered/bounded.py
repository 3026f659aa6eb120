"""Calls into a tier that return by a deadline, whatever the tier does.

A tier may block far past a caller's deadline: a Mooncake client whose master is stopped
waits for its RPC timeouts, a kv_file directory whose lock a peer holds waits for the lock.
The stack's own deadline must not depend on that. So a call into a lower tier runs on one of
the tier's own (daemon) threads, and the caller waits for it only until the deadline; a call
that misses it is *abandoned*: it runs on, and its answer is dropped (counted as that tier's
failure). While abandoned calls hold every thread of a tier, further calls skip the tier at
once rather than queue behind them.

What an abandoned call touches must outlive the caller: a write hands it buffers of its own
(never the engine's, which the engine reuses once the stack returns).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvcore.threads import start_thread

__all__ = ["BoundedCalls", "Missed"]

T = TypeVar("T")


class Missed(Exception):
    """The call did not return by its deadline, or every thread of the tier was busy."""


class _Job:
    __slots__ = ("abandoned", "done", "error", "fn", "keep", "result")

    def __init__(self, fn: Callable[[], Any], keep: object) -> None:
        self.fn = fn
        self.keep = keep  # what the call touches: alive until it returns
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.abandoned = False


class BoundedCalls:
    """Runs one tier's calls on ``threads`` threads of its own (see the module docstring)."""

    def __init__(self, name: str, threads: int = 4) -> None:
        self._name = name
        self._threads = threads
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._busy = 0  # calls running or queued
        self._started = 0
        self._closed = False

    def call(self, fn: Callable[[], T], deadline: float, keep: object = None) -> T:
        """``fn()``'s answer if it comes by ``deadline`` (a ``time.monotonic()`` instant);
        raises :class:`Missed` if not (or if every thread is held by abandoned calls), and
        what ``fn`` raised otherwise. ``keep``: what ``fn`` touches (buffers), kept alive
        until it returns, abandoned or not."""
        job = _Job(fn, keep)
        with self._lock:
            if self._closed or self._busy >= self._threads:
                raise Missed(f"{self._name}: every thread is busy with calls past their deadline")
            self._busy += 1
            if self._started < self._busy:
                self._started += 1
                start_thread(self._work, f"kv_tiered-{self._name}-{self._started}")
        self._jobs.put(job)
        if not job.done.wait(max(0.0, deadline - time.monotonic())):
            with self._lock:
                if not job.done.is_set():
                    job.abandoned = True
                    raise Missed(f"{self._name}: no answer by the deadline")
        if job.error is not None:
            raise job.error
        return job.result

    def close(self) -> None:
        """Let the threads end once their calls return (abandoned ones may still run)."""
        with self._lock:
            self._closed = True
            started = self._started
        for _ in range(started):
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job.result = job.fn()
            except BaseException as exc:  # handed to the caller (or dropped if abandoned)
                job.error = exc
            with self._lock:
                self._busy -= 1
                job.done.set()
            # drop the references (the caller may hold the job long after): never called again
            job.keep = job.fn = None  # type: ignore[assignment]
