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

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvcore.backend import Backend
from kvcore.errors import describe
from kvcore.handles import BackendHandle
from kvcore.metrics import Metrics, OnceLogger
from kvcore.requests import BlockRequest, FailureKind, HostBuffers, Outcome
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

#: What a job does: ``lookup`` (which blocks are stored), ``read``, ``write``, ``remove``.
JobOp = Literal["lookup", "read", "write", "remove"]
#: The requests of a job: one, several (run in order, their blocks answered in that order),
#: or a function of the opened backend that builds them when the job runs.
Requests = BlockRequest | Sequence[BlockRequest] | Callable[[Backend], Any]
#: ``fill(request, admitted)``: the host buffers of the ``admitted`` leading blocks of
#: ``request``, made once admission has answered (a refused block costs no copy).
Fill = Callable[[BlockRequest, int], HostBuffers]

#: The runner's counters, each kept per op (``<name>.<op>`` in :meth:`HostRunner.stats`,
#: ``kvcore_host_<name>_total{op=...}`` in Prometheus): the one vocabulary of every adapter.
COUNTERS = {
    "jobs": "jobs answered (a synchronous call is a job too)",
    "blocks": "blocks asked",
    "blocks_done": "blocks found (lookup), read, stored (write) or removed",
    "blocks_refused": "blocks the store's admission policy did not take: not written, no failure",
    "blocks_failed": "blocks not done because something failed (not because they are absent)",
    "bytes": "bytes read or written",
    "failures": "jobs that ended with a failure (their blocks not done are blocks_failed)",
    "deadline_missed": "jobs whose deadline passed before they ended (a counted miss)",
    "dropped": "jobs not run because their lane's queue was full",
    "cancelled": "jobs cancelled, or still queued when the runner closed",
    "unavailable": "jobs answered as misses because the store was not open",
    "errors": "jobs whose requests could not be built, or whose callback raised",
}

_READ_LANE = ("lookup", "read")


@dataclass(frozen=True, slots=True)
class HostResult:
    """The answer to one job: per block, in the order of the job's requests.

    :param done: whether each block was found (lookup), read, stored (write) or removed.
    :param refused: whether each block was refused by the store's admission policy (writes;
        a refused block is not written, and not a failure).
    :param failure: why blocks fell short because something failed (None: those not done are
        absent); ``kind`` is its :class:`kvcore.FailureKind`.
    :param requests: the requests the job ran (none when it never ran: dropped, cancelled,
        the store not open).

    .. versionadded:: 0.3
    """

    job_id: Hashable
    op: JobOp
    done: tuple[bool, ...]
    refused: tuple[bool, ...] = ()
    failure: str | None = None
    kind: FailureKind | None = None
    seconds: float = 0.0
    bytes: int = 0
    tag: Any = None
    requests: tuple[BlockRequest, ...] = field(default=(), repr=False)

    @property
    def blocks(self) -> int:
        return len(self.done)

    @property
    def count(self) -> int:
        """Blocks done (anywhere in the job)."""
        return sum(self.done)

    @property
    def leading(self) -> int:
        """Blocks done from the first on, up to the first that is not."""
        for i, ok in enumerate(self.done):
            if not ok:
                return i
        return len(self.done)

    @property
    def refused_count(self) -> int:
        return sum(self.refused)

    @property
    def handled(self) -> tuple[bool, ...]:
        """Per block: done, or refused by admission (nothing for the engine to retry)."""
        if not self.refused:
            return self.done
        return tuple(d or r for d, r in zip(self.done, self.refused, strict=True))

    @property
    def ok(self) -> bool:
        """Every block done or refused, and nothing failed."""
        return self.failure is None and all(self.handled)

    @property
    def outcome(self) -> Outcome:
        """The leading run as the facade's :class:`kvcore.Outcome` (with the failure)."""
        return Outcome(self.leading, self.failure, self.kind)


@dataclass(slots=True)
class _Part:
    """What one request of a job came to."""

    done: list[bool]
    refused: list[bool]
    failure: str | None = None
    kind: FailureKind | None = None


@dataclass(eq=False, slots=True)
class _Job:
    job_id: Hashable
    op: JobOp
    requests: Requests
    blocks: int | None
    deadline: float | None
    each: bool = False
    admit: bool = True
    fill: Fill | None = None
    tag: Any = None
    on_done: Callable[[HostResult], object] | None = None
    submitted: float = 0.0
    cancelled: bool = False
    #: run on the caller's thread (strict mode lets its exceptions reach the caller)
    sync: bool = False


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
        self._queued: dict[Hashable, _Job] = {}  # submitted, not yet started
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
        job = _Job(
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
        job = _Job(
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
        result = self._execute(job)
        self._count(result, job)
        return result

    def _run_queued(self, job: _Job) -> None:
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
                self._count(result, job)
            self._answer(job, result)
        except Exception as exc:  # strict mode's raise: a job is answered all the same
            log.exception("kvcore runner %r: a %s job failed", self.name, job.op)
            self._answer(job, self._unrun(job, describe(exc), "errors"))
        finally:
            with self._lock:
                self._running -= 1
                self._lock.notify_all()

    def _answer(self, job: _Job, result: HostResult) -> None:
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

    def _unrun(self, job: _Job, why: str, counter: str) -> HostResult:
        """The answer of a job that never ran: every block failed, counted under ``counter``."""
        n = self._known_blocks(job)
        kind = FailureKind.DEADLINE if counter == "deadline_missed" else FailureKind.BACKEND_ERROR
        result = HostResult(job.job_id, job.op, (False,) * n, failure=why, kind=kind, tag=job.tag)
        self.metrics.add(job.op, jobs=1, blocks=n, blocks_failed=n, failures=1, **{counter: 1})
        return result

    @staticmethod
    def _known_blocks(job: _Job) -> int:
        if job.blocks is not None:
            return job.blocks
        requests = job.requests
        if isinstance(requests, BlockRequest):
            return requests.num_blocks
        if callable(requests):
            return 0
        return sum(r.num_blocks for r in requests)

    def _execute(self, job: _Job) -> HostResult:
        """Run ``job``'s requests in order on this thread (uncounted: see :meth:`_count`)."""
        t0 = time.monotonic()
        backend = self.backend
        if backend is None:
            why = "the store is not open (tried again on its handle's schedule)"
            return self._failed(job, why, t0, "unavailable")
        try:
            requests = self._requests(job, backend)
        except Exception as exc:
            if job.sync or backend.strict:
                raise  # the caller's own input: its error is the caller's to see
            self._failures.warning(
                (job.op, "build", type(exc)),
                "kvcore runner %r: a %s job's requests could not be built: %s (further errors "
                "of this kind are logged at debug level)",
                self.name,
                job.op,
                describe(exc),
                exc_info=exc,
            )
            return self._failed(job, describe(exc), t0, "errors")
        parts: list[_Part] = []
        for request in requests:
            try:
                parts.append(self._one(backend, job, request))
            except Exception as exc:  # a door check (a malformed request), a fill that raised
                if job.sync or backend.strict:
                    raise  # the caller's own input: its error is the caller's to see
                n = request.num_blocks
                self._failures.warning(
                    (job.op, "call", type(exc)),
                    "kvcore runner %r: a %s call raised %s (task %r; further errors of this "
                    "kind are logged at debug level)",
                    self.name,
                    job.op,
                    describe(exc),
                    request.task_id,
                    exc_info=exc,
                )
                self.metrics.add(job.op, errors=1)
                parts.append(
                    _Part([False] * n, [False] * n, describe(exc), FailureKind.BACKEND_ERROR)
                )
        missing = (job.blocks or 0) - sum(r.num_blocks for r in requests)
        if missing > 0:  # the caller built fewer blocks than it announced: it refused them
            parts.append(_Part([False] * missing, [False] * missing))
        done = tuple(ok for p in parts for ok in p.done)
        refused = tuple(r for p in parts for r in p.refused) if job.op == "write" else ()
        failed = next((p for p in parts if p.failure is not None), None)
        moved = 0
        if job.op in ("read", "write"):
            for request, part in zip(requests, parts[: len(requests)], strict=True):
                if request.host is not None:
                    moved += sum(part.done) * sum(request.host.nbytes)
        return HostResult(
            job.job_id,
            job.op,
            done,
            refused,
            failure=None if failed is None else failed.failure,
            kind=None if failed is None else failed.kind,
            seconds=time.monotonic() - t0,
            bytes=moved,
            tag=job.tag,
            requests=tuple(requests),
        )

    def _failed(self, job: _Job, why: str, t0: float, counter: str) -> HostResult:
        """A job that could not run its requests (no store, no requests)."""
        self.metrics.add(job.op, **{counter: 1})
        n = self._known_blocks(job)
        return HostResult(
            job.job_id,
            job.op,
            (False,) * n,
            (False,) * n if job.op == "write" else (),
            failure=why,
            kind=FailureKind.BACKEND_ERROR,
            seconds=time.monotonic() - t0,
            tag=job.tag,
        )

    def _requests(self, job: _Job, backend: Backend) -> list[BlockRequest]:
        built = job.requests(backend) if callable(job.requests) else job.requests
        requests = [built] if isinstance(built, BlockRequest) else list(built)
        if job.deadline is not None:  # a submitted job: its deadline runs from submission
            requests = [
                r if r.deadline <= job.deadline else dataclasses.replace(r, deadline=job.deadline)
                for r in requests
            ]
        return requests

    def _one(self, backend: Backend, job: _Job, request: BlockRequest) -> _Part:
        """One request of a job, as the job's op and options say."""
        n = request.num_blocks
        if n == 0:
            return _Part([], [])
        op = job.op
        if op == "lookup":
            if job.each:
                presence = backend.contains(request)
                return _Part(list(presence.found), [False] * n, presence.failure, presence.kind)
            return _leading(backend.query(request), n)
        if op == "remove":
            return _leading(backend.remove(request), n)
        if op == "read":
            if job.each:
                return _each_block(request, 0, n, backend.read)
            return _leading(backend.read(request), n)
        if job.fill is None and not job.each:  # the one call that asks, then writes
            written = backend.write(request, admit=job.admit)
            part = _leading(written, n - written.refused)
        else:  # admission first; then the admitted run is filled, or written block by block
            admitted = int(backend.admit(request)) if job.admit else n
            if admitted == 0:
                return _Part([False] * n, [True] * n)
            host = request.host
            if job.fill is not None:
                host = job.fill(request, admitted)
            elif host is not None and admitted < n:
                host = host.slice(0, admitted)
            if admitted < n or host is not request.host:
                request = request.slice(0, admitted, host=host)
            if job.each:
                part = _each_block(request, 0, admitted, backend.write)
            else:
                part = _leading(backend.write(request), admitted)
        refused = n - len(part.done)
        part.done.extend([False] * refused)
        part.refused.extend([True] * refused)
        return part

    def _count(self, result: HostResult, job: _Job) -> None:
        """One job's counters and latency (the vocabulary of :data:`COUNTERS`)."""
        n = result.blocks
        done = result.count
        refused = result.refused_count
        late = result.kind is FailureKind.DEADLINE or (
            job.deadline is not None and time.monotonic() > job.deadline
        )
        counts = {
            "jobs": 1,
            "blocks": n,
            "blocks_done": done,
            "bytes": result.bytes,
            "failures": int(result.failure is not None),
            "blocks_failed": n - done - refused if result.failure is not None else 0,
            "deadline_missed": int(late),
        }
        if refused:
            counts["blocks_refused"] = refused
        self.metrics.observe(job.op, result.seconds, **counts)


def _leading(outcome: Outcome, n: int) -> _Part:
    """A leading-run answer as per-block flags."""
    got = int(outcome)
    done = [True] * got + [False] * (n - got)
    return _Part(done, [False] * n, outcome.failure, outcome.kind)


def _each_block(
    request: BlockRequest, lo: int, hi: int, call: Callable[[BlockRequest], Outcome]
) -> _Part:
    """Blocks ``lo .. hi - 1`` of ``request`` one by one where they must be: ``call`` (a
    leading-run read or write) takes the rest of the run; after a short answer the block it
    stopped at is failed and the call goes on from the next, until the deadline passes."""
    done: list[bool] = []
    failure: str | None = None
    kind: FailureKind | None = None
    while lo + len(done) < hi:
        at = lo + len(done)
        host = None if request.host is None else request.host.slice(at, hi)
        got = call(request.slice(at, hi, host=host))
        done.extend([True] * int(got))
        if got.failure is not None and failure is None:
            failure, kind = got.failure, got.kind
        if lo + len(done) < hi:
            done.append(False)
            if got.kind is FailureKind.DEADLINE:
                done.extend([False] * (hi - lo - len(done)))
    return _Part(done, [False] * len(done), failure, kind)
