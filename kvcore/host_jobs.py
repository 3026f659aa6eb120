"""What a host job is and how it runs: the requests of one lookup, read, write or removal
against one opened backend, answered per block (:class:`HostResult`).

:class:`kvcore.HostRunner` decides where and when a job runs (the caller's thread, or its lanes)
and answers it; this module runs it: the requests built from the opened backend where the job
gives a function, the store's admission asked inside every write (or asked, then ``fill``
called for the admitted blocks only), a leading run or each block on its own, and the job's
counters (:data:`COUNTERS`, the one vocabulary of every adapter).

.. versionadded:: 0.3
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Literal

from kvcore.backend import Backend
from kvcore.errors import describe
from kvcore.metrics import Metrics
from kvcore.requests import BlockRequest, FailureKind, HostBuffers, Outcome

__all__ = [
    "COUNTERS",
    "Fill",
    "HostJob",
    "HostResult",
    "JobOp",
    "Requests",
    "count",
    "run",
    "unrun",
]

#: What a job does: ``lookup`` (which blocks are stored), ``read``, ``write``, ``remove``.
JobOp = Literal["lookup", "read", "write", "remove"]
#: The requests of a job: one, several (run in order, their blocks answered in that order),
#: or a function of the opened backend that builds them when the job runs.
Requests = BlockRequest | Sequence[BlockRequest] | Callable[[Backend], Any]
#: ``fill(request, admitted)``: the host buffers of the ``admitted`` leading blocks of
#: ``request``, made once admission has answered (a refused block costs no copy).
Fill = Callable[[BlockRequest, int], HostBuffers]

#: The runner's counters, each kept per op (``<name>.<op>`` in :meth:`kvcore.HostRunner.stats`,
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
        try:
            return self.done.index(False)
        except ValueError:
            return len(self.done)

    @property
    def refused_count(self) -> int:
        return sum(self.refused)

    @property
    def handled(self) -> tuple[bool, ...]:
        """Per block: done, or refused by admission (nothing for the engine to retry)."""
        if not self.refused:
            return self.done
        return tuple(map(operator.or_, self.done, self.refused))

    @property
    def ok(self) -> bool:
        """Every block done or refused, and nothing failed."""
        return self.failure is None and all(self.handled)

    @property
    def outcome(self) -> Outcome:
        """The leading run as the facade's :class:`kvcore.Outcome` (with the failure)."""
        return Outcome(self.leading, self.failure, self.kind)


@dataclass(slots=True)
class JobPart:
    """What one request of a job came to."""

    done: list[bool]
    refused: list[bool]
    failure: str | None = None
    kind: FailureKind | None = None


@dataclass(eq=False, slots=True)
class HostJob:
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


#: ``report(op, what, exc, task_id)``: a job's own error (a request that could not be built,
#: a call that raised), logged once by the runner and counted (``errors``)
ErrorReport = Callable[[str, str, Exception, str | None], None]


def known_blocks(job: HostJob) -> int:
    """How many blocks ``job`` answers (before its requests are built, where a function
    builds them: as the job announced)."""
    if job.blocks is not None:
        return job.blocks
    requests = job.requests
    if isinstance(requests, BlockRequest):
        return requests.num_blocks
    if callable(requests):
        return 0
    return sum(r.num_blocks for r in requests)


def unrun(job: HostJob, why: str, kind: FailureKind, t0: float | None = None) -> HostResult:
    """The answer of a job whose requests never ran: every block failed, for ``why``."""
    n = known_blocks(job)
    return HostResult(
        job.job_id,
        job.op,
        (False,) * n,
        (False,) * n if job.op == "write" else (),
        failure=why,
        kind=kind,
        seconds=0.0 if t0 is None else time.monotonic() - t0,
        tag=job.tag,
    )


def run(job: HostJob, backend: Backend, report: ErrorReport) -> HostResult:
    """Run ``job``'s requests in order on this thread against ``backend`` (uncounted: see
    :func:`count`). The caller's own errors (a request that cannot be built or that the
    facade's door refuses, a ``fill`` that raises) are raised to a synchronous caller, and in
    strict mode; else reported and answered as failed blocks."""
    t0 = time.monotonic()
    try:
        requests = _requests(job, backend)
    except Exception as exc:
        if job.sync or backend.strict:
            raise  # the caller's own input: its error is the caller's to see
        report(job.op, "requests could not be built", exc, None)
        return unrun(job, describe(exc), FailureKind.BACKEND_ERROR, t0)
    parts: list[JobPart] = []
    for request in requests:
        try:
            parts.append(_one(backend, job, request))
        except Exception as exc:  # a door check (a malformed request), a fill that raised
            if job.sync or backend.strict:
                raise
            report(job.op, "call raised", exc, request.task_id)
            n = request.num_blocks
            parts.append(
                JobPart([False] * n, [False] * n, describe(exc), FailureKind.BACKEND_ERROR)
            )
    missing = (job.blocks or 0) - sum(r.num_blocks for r in requests)
    if missing > 0:  # the caller built fewer blocks than it announced: it refused them
        parts.append(JobPart([False] * missing, [False] * missing))
    # flags joined in C, not a Python step per block: a scheduler's lookups are 10,000s long
    if len(parts) == 1:  # the common job: one request
        done = tuple(parts[0].done)
        refused = tuple(parts[0].refused) if job.op == "write" else ()
    else:
        done = tuple(chain.from_iterable(p.done for p in parts))
        refused = tuple(chain.from_iterable(p.refused for p in parts)) if job.op == "write" else ()
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


def count(metrics: Metrics, job: HostJob, result: HostResult, **more: int) -> None:
    """One job's counters and latency (the vocabulary of :data:`COUNTERS`; ``more``: why it
    never ran, ``dropped=1`` say). Counters that did not move this time are left alone: a
    synchronous call of an engine's (SGLang's 128-page lookups) pays for what happened only."""
    n = len(result.done)
    done = result.count
    counts = {"jobs": 1, "blocks": n, "blocks_done": done, **more}
    if result.bytes:
        counts["bytes"] = result.bytes
    refused = sum(result.refused) if result.refused else 0
    if refused:
        counts["blocks_refused"] = refused
    if result.failure is not None:
        counts["failures"] = 1
        counts["blocks_failed"] = n - done - refused
    if result.kind is FailureKind.DEADLINE or (
        job.deadline is not None and time.monotonic() > job.deadline
    ):
        counts["deadline_missed"] = 1
    metrics.observe(job.op, result.seconds, **counts)


def _requests(job: HostJob, backend: Backend) -> list[BlockRequest]:
    built = job.requests(backend) if callable(job.requests) else job.requests
    requests = [built] if isinstance(built, BlockRequest) else list(built)
    if job.deadline is not None:  # a submitted job: its deadline runs from submission
        requests = [
            r if r.deadline <= job.deadline else dataclasses.replace(r, deadline=job.deadline)
            for r in requests
        ]
    return requests


def _one(backend: Backend, job: HostJob, request: BlockRequest) -> JobPart:
    """One request of a job, as the job's op and options say."""
    n = request.num_blocks
    if n == 0:
        return JobPart([], [])
    op = job.op
    if op == "lookup":
        if job.each:
            presence = backend.contains(request)
            return JobPart(list(presence.found), [False] * n, presence.failure, presence.kind)
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
            return JobPart([False] * n, [True] * n)
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


def _leading(outcome: Outcome, n: int) -> JobPart:
    """A leading-run answer as per-block flags."""
    got = int(outcome)
    done = [True] * got + [False] * (n - got)
    return JobPart(done, [False] * n, outcome.failure, outcome.kind)


def _each_block(
    request: BlockRequest, lo: int, hi: int, call: Callable[[BlockRequest], Outcome]
) -> JobPart:
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
    return JobPart(done, [False] * len(done), failure, kind)
