"""The cores kvcore's worker threads run on: the process's, not the pinning of whoever starts them.

A thread inherits the CPU affinity of the thread that creates it. CPU inference engines pin
their compute threads one per core: vLLM's CPU worker binds its OpenMP threads, its own main
thread included, to one core each before it builds a KV connector. Every pool kvcore or a
backend starts from such a thread then runs all its copies, checksums and system calls on that
one core, beside the model's compute thread of that core (seen in vLLM 0.32's CPU worker on
this project's 2-core machine: every kvcore and kv_file thread allowed on core 0 only, the
engine's other OpenMP thread alone on core 1).

So every thread kvcore starts, and every thread a backend starts while it is opened or through
:func:`thread_pool`, first moves onto the **I/O cores**:

- ``KVCORE_IO_CPUS`` when set (``"2,3"``, ``"8-15"``, ``"0-3,8-11"``): an operator reserving
  cores for storage work (vLLM reserves cores beside its OpenMP ones for KV connectors);
- else the union of the cores any thread of this process may use: what the engine gave the
  process (its cgroup, its NUMA binding per rank), without one thread's pinning.

Nothing here changes the affinity of a thread kvcore did not start, except for the duration
of :func:`io_affinity`, which restores it.

A pool of threads that only wait on something else's work (a client library that polls a
transfer until it ends) can ask for the **lowest CPU priority** (``thread_pool(...,
background=True)``): they share the I/O cores with the engine's compute, and a thread that polls
without pause would take one of them whole for as long as it waits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvcore.errors import ConfigError

__all__ = [
    "BACKGROUND_NICE",
    "IO_CPUS_ENV",
    "QueueFullError",
    "WorkerPool",
    "io_affinity",
    "io_cpus",
    "lower_priority",
    "move_to_io_cpus",
    "parse_cpu_list",
    "set_io_cpus",
    "start_thread",
    "thread_pool",
    "usable_cpus",
]

log = logging.getLogger(__name__)

#: Environment variable naming the cores kvcore's threads run on.
IO_CPUS_ENV = "KVCORE_IO_CPUS"

_chosen: frozenset[int] | None = None  # set_io_cpus
_cached: tuple[int, frozenset[int]] | None = None  # (pid, cores) of the default


def parse_cpu_list(text: str, what: str = IO_CPUS_ENV) -> frozenset[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8}; a ConfigError naming ``what`` for anything else."""
    cpus: set[int] = set()
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        first, sep, last = item.partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ConfigError(
                f"{what}: {item!r} is not a core number or a range such as '2-5' (in {text!r})"
            ) from None
        if lo < 0 or hi < lo:
            raise ConfigError(f"{what}: {item!r} is not an ascending range of core numbers")
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise ConfigError(f"{what}: {text!r} names no core")
    return frozenset(cpus)


def _process_cpus() -> frozenset[int]:
    """The union of the cores this process's threads may run on."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset(range(os.cpu_count() or 1))
    cores: set[int] = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):  # a thread may end meanwhile
                cores.update(os.sched_getaffinity(int(tid)))
    if not cores:
        cores.update(os.sched_getaffinity(0))
    return frozenset(cores)


def io_cpus() -> frozenset[int]:
    """The cores kvcore's threads run on (see the module docstring)."""
    global _cached
    if _chosen is not None:
        return _chosen
    env = os.environ.get(IO_CPUS_ENV, "").strip()
    if env:
        return parse_cpu_list(env)
    pid = os.getpid()
    cached = _cached
    if cached is None or cached[0] != pid:  # computed once per process (again after a fork)
        cached = _cached = (pid, _process_cpus())
    return cached[1]


def set_io_cpus(cpus: Iterable[int] | str | None) -> None:
    """Choose the I/O cores for this process (a list, or ``"0-3,8"``); None: the default.

    Threads already running keep their cores; those started afterwards use the new ones.
    """
    global _chosen
    if cpus is None:
        chosen = None
    elif isinstance(cpus, str):
        chosen = parse_cpu_list(cpus, "io_cpus")
    else:
        chosen = frozenset(int(c) for c in cpus)
        if not chosen or min(chosen) < 0:
            raise ConfigError(f"io_cpus: {sorted(chosen)} names no valid core")
    _chosen = chosen


def usable_cpus() -> int:
    """How many cores kvcore's threads share: the bound on useful CPU-bound parallelism."""
    return max(1, len(io_cpus()))


def move_to_io_cpus() -> None:
    """Move the calling thread onto the I/O cores (a no-op where affinity is not supported)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        cores = io_cpus()
        if os.sched_getaffinity(0) != cores:
            os.sched_setaffinity(0, cores)
    except (OSError, ConfigError) as exc:  # a bad setting must not kill an I/O thread
        log.warning(
            "kvcore: thread %s stays on its cores: %s", threading.current_thread().name, exc
        )


@contextlib.contextmanager
def io_affinity() -> Iterator[None]:
    """Run the block with the calling thread on the I/O cores, then restore its own.

    For code that starts threads kvcore does not create itself (a backend's client library
    opening its connections): they inherit the I/O cores instead of the caller's pinning.
    """
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    try:
        before = os.sched_getaffinity(0)
    except OSError:
        yield
        return
    move_to_io_cpus()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if os.sched_getaffinity(0) != before:
                os.sched_setaffinity(0, before)


def start_thread(
    target: Callable[..., Any], name: str, args: tuple[Any, ...] = (), daemon: bool = True
) -> threading.Thread:
    """Start a daemon thread that runs ``target(*args)`` on the I/O cores."""

    def run() -> None:
        move_to_io_cpus()
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


#: The nice value of a background thread (:func:`lower_priority`): the lowest priority, so a
#: thread at the default priority on the same core gets ~98 % of it under Linux's scheduler
#: (weights 15 against 1024) and the background thread all the time no one else wants.
BACKGROUND_NICE = 19


def lower_priority() -> None:
    """Give the calling thread the lowest CPU priority (:data:`BACKGROUND_NICE`).

    Linux keeps a nice value per thread (``setpriority`` on the thread's id changes only that
    thread); elsewhere, or where it fails, the thread keeps its priority. It cannot be raised
    again without privileges: call this only on a thread that stays in the background.
    Threads it starts afterwards inherit it.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError as exc:
        log.debug("kvcore: thread %s keeps its priority: %s", threading.current_thread().name, exc)


def _background_thread() -> None:
    move_to_io_cpus()
    lower_priority()


def thread_pool(
    max_workers: int, thread_name_prefix: str, *, background: bool = False
) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` whose threads run on the I/O cores; ``background``: at the
    lowest CPU priority too (:func:`lower_priority`), for threads that wait on work done
    elsewhere and must not take a core from the engine while they do.

    .. versionchanged:: 0.3
       ``background``.
    """
    return ThreadPoolExecutor(
        max_workers,
        thread_name_prefix=thread_name_prefix,
        initializer=_background_thread if background else move_to_io_cpus,
    )


class QueueFullError(RuntimeError):
    """The pool's queue stayed full for the whole wait (back-pressure)."""


_STOP = object()


class WorkerPool:
    """A fixed set of threads fed by a bounded queue.

    ``submit`` waits up to ``wait_s`` for room in the queue and then raises
    :class:`QueueFullError`: the engine decides what a rejected task means (a miss).
    """

    def __init__(self, name: str, workers: int, queue_depth: int) -> None:
        self.name = name
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_depth)
        self._inflight = 0
        self._idle = threading.Condition()
        self._threads = [start_thread(self._run, f"kvcore-{name}-{i}") for i in range(workers)]

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

    def shutdown(self, timeout_s: float | None = 5.0) -> None:
        """Stop the threads once the tasks queued before this call have run; wait for each up
        to ``timeout_s`` (None: until it ends)."""
        for _ in self._threads:
            try:
                self._queue.put(_STOP, timeout=timeout_s)
            except queue.Full:
                break
        for t in self._threads:
            t.join(timeout=timeout_s)
