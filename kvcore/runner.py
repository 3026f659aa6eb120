"""The engine-side runner: every adapter's lookups, reads and writes of host buffers, one way.

An engine that owns its host memory (vLLM's CPU tier, SGLang's host pool, FastDeploy's
staging buffers, LMCache's L1 arena) moves blocks with requests whose ``host`` buffers point
into that memory. :class:`HostRunner` is where every such request runs, so what each adapter
once rebuilt lives once:

- **where it runs**: on the caller's thread (:meth:`~HostRunner.lookup`,
  :meth:`~HostRunner.read`, :meth:`~HostRunner.write`: SGLang's and FastDeploy's calls are
  synchronous) or as a job on the runner's bounded threads (``submit_*``: one lane for lookups
  and reads, one for writes and removals, so a slow store's writes never hold a load back),
  answered through :meth:`~HostRunner.get_finished` or a callback; :meth:`~HostRunner.wait`,
  :meth:`~HostRunner.cancel` and a :meth:`~HostRunner.close` that joins the threads, in the
  shape of vLLM's offloading handlers (submit a job, poll what finished);
- **admission**, asked once inside every write (``admit=True``, the default): blocks the
  store's policy refuses are not written and are not failures. A caller that fills its buffers
  only for the blocks admitted passes ``fill`` instead of asking first;
- **deadlines**: a job still queued at its deadline is never started, and a short answer at
  the deadline is the facade's ``deadline`` (:class:`kvcore.FailureKind`): both counted misses;
- **a store that is not open** (a :class:`kvcore.BackendHandle` retrying on its schedule): a
  counted miss, never an exception; nor is a backend's failure. What the caller itself got
  wrong (a request the facade's door refuses, a ``fill`` or a request builder that raises) is
  raised to a synchronous caller, and a counted error (``errors``) of a job;
- **one counter vocabulary** for every adapter (:data:`COUNTERS`, per op);
- **per-block answers** (``each=True``) for engines that ask about every block on its own
  (LMCache's bitmaps): after a block that failed, the run goes on from the next one.

A request a job runs may be given built, or as a function of the opened backend (built when
the job runs, by its thread: the engine's thread never waits for object names, and a store
that is not open builds nothing); ``blocks`` then says how many blocks it will have (blocks it
does not build are answered not done: a caller refusing them, with its own reason counted).

.. versionadded:: 0.3
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from kvcore import host_jobs as jobs
from kvcore.backend import Backend
from kvcore.config import LoadPolicy
from kvcore.errors import describe
from kvcore.handles import BackendHandle
from kvcore.host_jobs import COUNTERS, Fill, HostJob, HostResult, JobOp, Requests
from kvcore.load_costs import LoadChoice, LoadDecider
from kvcore.metrics import Metrics, OnceLogger
from kvcore.requests import BlockRequest, FailureKind
from kvcore.threads import QueueFullError, WorkerPool

__all__ = [
    "COUNTERS",
    "Fill",
    "HostResult",
    "HostRunner",
    "JobOp",
    "Requests",
]

log = logging.getLogger("kvcore.runner")

_READ_LANE = ("lookup", "read")


class HostRunner:
    """Runs lookups, reads and writes of host buffers against one backend (see the module
    docstring). Thread-safe.

    :param backend: an opened :class:`kvcore.Backend`, or a :class:`kvcore.BackendHandle`
        (opened when due; while it cannot be, every job is a counted miss), or a function
        answering the backend to use now or None (an adapter that lets its tests put a
        wrapped backend in the store's place).
    :param name: what the runner's threads and metrics are called (``kvcore-<name>-...``).
    :param read_workers: threads of the lane that runs submitted lookups and reads.
    :param write_workers: threads of the lane that runs submitted writes and removals.
    :param max_queued: jobs a lane holds before it drops new ones (each answered at once,
        failed, counted ``dropped``): a slow store never holds the engine's buffers; an int
        for both lanes, or ``(reads, writes)``.
    :param timeout_s: a submitted job's deadline, from submission, when ``submit_*`` gives
        none (None: the backend's ``default_timeout_s``). Each request's own deadline is kept
        if it is sooner.

    Threads start with the first submitted job: a runner used only synchronously starts none.

    .. versionadded:: 0.3
    """

    def __init__(
        self,
        backend: Backend | BackendHandle | Callable[[], Backend | None],
        *,
        name: str = "host",
        read_workers: int = 2,
        write_workers: int = 2,
        max_queued: int | tuple[int, int] = 1024,
        timeout_s: float | None = None,
    ) -> None:
        if read_workers < 1 or write_workers < 1:
            raise ValueError(
                f"read_workers ({read_workers}) and write_workers ({write_workers}) must be >= 1"
            )
        reads, writes = (max_queued, max_queued) if isinstance(max_queued, int) else max_queued
        if reads < 1 or writes < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self._handle = backend if isinstance(backend, BackendHandle) else None
        self._fixed = backend if isinstance(backend, Backend) else None
        self._source: Callable[[], Backend | None] | None = None
        if not isinstance(backend, Backend | BackendHandle):
            self._source = backend
        if isinstance(backend, BackendHandle):
            label = backend.label
        else:
            label = backend.name if isinstance(backend, Backend) else name
        self.name = name
        self.metrics = Metrics("kvcore_host", {"backend": label, "runner": name})
        self._workers = {"read": read_workers, "write": write_workers}
        self._max_queued = {"read": reads, "write": writes}
        self._timeout_s = timeout_s
        self._failures = OnceLogger(log)
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._lanes: dict[str, WorkerPool] = {}
        self._queued: dict[Hashable, HostJob] = {}  # submitted, not yet started
        self._running = 0
        self._finished: deque[HostResult] = deque()
        self._closed = False

    # -- the store -------------------------------------------------------------------------

    @property
    def backend(self) -> Backend | None:
        """The opened backend, opening it if due; None while it cannot be opened."""
        if self._fixed is not None:
            return self._fixed
        if self._handle is not None:
            return self._handle.get()
        assert self._source is not None
        return self._source()

    @property
    def opened(self) -> Backend | None:
        """The backend if it is open now (never opens it; a source is asked)."""
        if self._handle is not None:
            return self._handle.opened
        return self.backend

    # -- synchronous calls, on the caller's thread -----------------------------------------

    def lookup(
        self, requests: Requests, *, blocks: int | None = None, each: bool = False
    ) -> HostResult:
        """Which blocks are stored: the leading run (``query``), or each block on its own
        (``each=True``: ``contains``, gaps included)."""
        return self._run_now("lookup", requests, blocks, each=each)

    def read(
        self, requests: Requests, *, blocks: int | None = None, each: bool = False
    ) -> HostResult:
        """Read into the requests' host buffers: the leading run, or every block that can be
        (``each=True``: after a block that failed, on from the next)."""
        return self._run_now("read", requests, blocks, each=each)

    def write(
        self,
        requests: Requests,
        *,
        blocks: int | None = None,
        admit: bool = True,
        each: bool = False,
        fill: Fill | None = None,
    ) -> HostResult:
        """Store what the store's admission policy admits (``admit=False``: everything; for a
        caller that asked already). ``fill`` makes each request's host buffers once admission
        has answered, for its admitted leading blocks only."""
        return self._run_now("write", requests, blocks, each=each, admit=admit, fill=fill)

    def remove(self, requests: Requests, *, blocks: int | None = None) -> HostResult:
        """Remove the blocks (``kvcore_remove``); ``done`` marks as many as were removed,
        leading, for the backend says how many and not which."""
        return self._run_now("remove", requests, blocks)

    # -- jobs, on the runner's threads -----------------------------------------------------

    def submit_lookup(
        self, requests: Requests, *, blocks: int | None = None, each: bool = False, **job: Any
    ) -> Hashable:
        """:meth:`lookup` as a job; see :meth:`submit` for ``job``'s keywords."""
        return self.submit("lookup", requests, blocks=blocks, each=each, **job)

    def submit_read(
        self, requests: Requests, *, blocks: int | None = None, each: bool = False, **job: Any
    ) -> Hashable:
        """:meth:`read` as a job; see :meth:`submit` for ``job``'s keywords."""
        return self.submit("read", requests, blocks=blocks, each=each, **job)

    def submit_write(
        self,
        requests: Requests,
        *,
        blocks: int | None = None,
        admit: bool = True,
        each: bool = False,
        **job: Any,
    ) -> Hashable:
        """:meth:`write` as a job; see :meth:`submit` for ``job``'s keywords."""
        return self.submit("write", requests, blocks=blocks, admit=admit, each=each, **job)

    def submit_remove(
        self, requests: Requests, *, blocks: int | None = None, **job: Any
    ) -> Hashable:
        """:meth:`remove` as a job; see :meth:`submit` for ``job``'s keywords."""
        return self.submit("remove", requests, blocks=blocks, **job)

    def submit(
        self,
        op: JobOp,
        requests: Requests,
        *,
        blocks: int | None = None,
        each: bool = False,
        admit: bool = True,
        fill: Fill | None = None,
        job_id: Hashable | None = None,
        tag: Any = None,
        timeout_s: float | None = None,
        on_done: Callable[[HostResult], object] | None = None,
    ) -> Hashable:
        """Queue a job on its lane; returns its id (``job_id``, or one the runner picks).

        Its :class:`HostResult` (carrying ``tag``) goes to ``on_done``, called on the runner's
        thread, or, without one, to :meth:`get_finished`. Never blocks and never raises for
        the store's sake: a full lane, a closed runner or a store that is not open answer
        the job at once, failed and counted.
        """
        if op not in ("lookup", "read", "write", "remove"):
            raise ValueError(f"op {op!r} is not one of lookup, read, write, remove")
        now = time.monotonic()
        timeout = self._timeout_s if timeout_s is None else timeout_s
        if timeout is None:
            backend = self.opened
            timeout = backend.config.default_timeout_s if backend is not None else None
        job = HostJob(
            job_id=next(self._ids) if job_id is None else job_id,
            op=op,
            requests=requests,
            blocks=blocks,
            deadline=None if timeout is None else now + timeout,
            each=each,
            admit=admit,
            fill=fill,
            tag=tag,
            on_done=on_done,
            submitted=now,
        )
        lane = "read" if op in _READ_LANE else "write"
        with self._lock:
            pool = None if self._closed else self._lanes.get(lane)
            if pool is None and not self._closed:
                pool = self._lanes[lane] = WorkerPool(
                    f"{self.name}-{lane}", self._workers[lane], self._max_queued[lane]
                )
            if pool is not None:
                self._queued[job.job_id] = job
        if pool is None:
            self._answer(job, self._unrun(job, "the runner is closed", "cancelled"))
            return job.job_id
        try:
            pool.submit(lambda: self._run_queued(job), 0)
        except QueueFullError as exc:
            with self._lock:
                self._queued.pop(job.job_id, None)
            self._answer(job, self._unrun(job, describe(exc), "dropped"))
        return job.job_id

    def get_finished(self) -> list[HostResult]:
        """The results of the jobs that finished since the last call (those without an
        ``on_done``), in the order they finished."""
        out = []
        with self._lock:
            while self._finished:
                out.append(self._finished.popleft())
        return out

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet answered (queued or running)."""
        with self._lock:
            return len(self._queued) + self._running

    @property
    def ready(self) -> int:
        """Results waiting for :meth:`get_finished`."""
        with self._lock:
            return len(self._finished)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted job is answered (up to ``timeout_s``; None: until they
        are); False if some are not."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._queued and not self._running, timeout_s)

    def cancel(self, job_id: Hashable) -> bool:
        """Cancel a job that has not started: it is answered failed (``cancelled``) and never
        runs. False when it has started or ended (a running job is never interrupted: its
        backend call may be using the engine's buffers)."""
        with self._lock:
            job = self._queued.get(job_id)
            if job is None or job.cancelled:
                return False
            job.cancelled = True
            return True

    def plan_load(
        self,
        decider: LoadDecider,
        found: int,
        *,
        block_bytes: int,
        block_tokens: int,
        start_tokens: int = 0,
        prompt_tokens: int | None = None,
        policy: LoadPolicy | None = None,
        probe: BlockRequest | Callable[[Backend], BlockRequest] | None = None,
    ) -> LoadChoice:
        """How many of the ``found`` leading blocks a lookup found to load: ``decider``'s
        choice (:mod:`kvcore.load_costs`) over this runner's store, weighed by its measured
        read rate (measured first by a few reads of ``probe``'s blocks where it is unknown:
        :meth:`LoadDecider.decide_over`; ``probe`` a request without buffers, or what builds
        it for the opened backend, as :meth:`lookup` takes). ``prompt_tokens`` defaults to the tokens through the
        found blocks (an engine that asks about stored pages only). A store that is not open:
        nothing loads.

        .. versionadded:: 0.3
        """
        backend = self.opened
        if backend is None or found <= 0:
            return LoadChoice(0, max(0, found), "unavailable")
        end = start_tokens + found * block_tokens
        return decider.decide_over(
            backend,
            found,
            probe=probe(backend) if callable(probe) else probe,
            block_bytes=block_bytes,
            block_tokens=block_tokens,
            start_tokens=start_tokens,
            prompt_tokens=end if prompt_tokens is None else prompt_tokens,
            policy=policy,
        )

    def stats(self, prefix: str = "host.") -> dict[str, float]:
        """The runner's counters (``<prefix><name>.<op>``, :data:`COUNTERS`), latencies
        (``latency_count.<op>``, ``latency_sum_s.<op>``) and ``pending`` jobs. The prefix
        keeps them apart from the facade's per-call counters of the same names (an
        adapter's stats hold both): every adapter reports ``host.blocks_refused.write``."""
        out = {f"{prefix}{name}": value for name, value in self.metrics.snapshot().items()}
        out[f"{prefix}pending"] = float(self.pending)
        return out

    def close(self, timeout_s: float | None = None, *, finish_queued: bool = False) -> None:
        """Take no more jobs, answer those still queued as cancelled (``finish_queued``: run
        them first, for jobs that must not be lost: a deferred removal), and join the threads
        once the running ones end (each by its deadline; up to ``timeout_s`` per lane, None:
        until they do). The backend is not closed: whoever opened it closes it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not finish_queued:
                for job in self._queued.values():
                    job.cancelled = True
            lanes = list(self._lanes.values())
        for pool in lanes:  # the queued jobs run first, each answered at once as cancelled
            pool.shutdown(timeout_s)

    def __enter__(self) -> HostRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _run_now(
        self,
        op: JobOp,
        requests: Requests,
        blocks: int | None,
        *,
        each: bool = False,
        admit: bool = True,
        fill: Fill | None = None,
    ) -> HostResult:
        job = HostJob(
            job_id=None,
            op=op,
            requests=requests,
            blocks=blocks,
            deadline=None,
            each=each,
            admit=admit,
            fill=fill,
            submitted=time.monotonic(),
            sync=True,
        )
        return self._execute(job)

    def _run_queued(self, job: HostJob) -> None:
        with self._lock:
            self._queued.pop(job.job_id, None)
            self._running += 1
        try:
            if job.cancelled:
                result = self._unrun(job, "cancelled", "cancelled")
            elif job.deadline is not None and time.monotonic() >= job.deadline:
                result = self._unrun(
                    job, "the deadline passed while the job was queued", "deadline_missed"
                )
            else:
                result = self._execute(job)
            self._answer(job, result)
        except Exception as exc:  # strict mode's raise: a job is answered all the same
            log.exception("kvcore runner %r: a %s job failed", self.name, job.op)
            self._answer(job, self._unrun(job, describe(exc), "errors"))
        finally:
            with self._lock:
                self._running -= 1
                self._lock.notify_all()

    def _answer(self, job: HostJob, result: HostResult) -> None:
        """Hand ``result`` to the job's callback, or to :meth:`get_finished`."""
        if job.on_done is None:
            with self._lock:
                self._finished.append(result)
                self._lock.notify_all()
            return
        try:
            job.on_done(result)
        except Exception as exc:
            self.metrics.add(job.op, errors=1)
            self._failures.warning(
                (job.op, "callback", type(exc)),
                "kvcore runner %r: the %s job's callback raised %s (further errors of this "
                "kind are logged at debug level)",
                self.name,
                job.op,
                describe(exc),
                exc_info=exc,
            )

    def _unrun(self, job: HostJob, why: str, counter: str) -> HostResult:
        """The answer of a job that never ran: every block failed, counted under ``counter``."""
        kind = FailureKind.DEADLINE if counter == "deadline_missed" else FailureKind.BACKEND_ERROR
        result = jobs.unrun(job, why, kind)
        jobs.count(self.metrics, job, result, **{counter: 1})
        return result

    def _execute(self, job: HostJob) -> HostResult:
        """Run ``job`` on this thread and count it."""
        backend = self.backend
        if backend is None:
            result = jobs.unrun(
                job,
                "the store is not open (tried again on its handle's schedule)",
                FailureKind.BACKEND_ERROR,
            )
            jobs.count(self.metrics, job, result, unavailable=1)
            return result
        result = jobs.run(job, backend, self._report)
        jobs.count(self.metrics, job, result)
        return result

    def _report(self, op: str, what: str, exc: Exception, task_id: str | None) -> None:
        """A job's own error: logged once per kind, counted (``errors``)."""
        self.metrics.add(op, errors=1)
        self._failures.warning(
            (op, what, type(exc)),
            "kvcore runner %r: a %s job's %s: %s%s (further errors of this kind are logged "
            "at debug level)",
            self.name,
            op,
            what,
            describe(exc),
            "" if task_id is None else f" (task {task_id!r})",
            exc_info=exc,
        )
