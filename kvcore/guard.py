"""The call guard: how the facade (:class:`kvcore.Backend`) calls a backend's hooks.

Whatever a hook does - raise, answer what the contract forbids, overrun its deadline - its
caller gets a well-formed answer and a counter moves; in strict mode (a backend's own tests)
the fault is raised instead, so it is seen where it happens. The kind of a short count is
decided here, once, for every backend: short and at (or past) the deadline is a deadline
(:meth:`CallGuard.count`).

One :class:`CallGuard` per opened backend holds what all its calls share: the backend's name
(in every message), strict mode, the metrics, the lock that serialises the calls of a backend
that is not concurrent, the logger that logs each kind of failure once, and whether the backend
is closed (its data calls are then refused).

.. versionadded:: 0.3 (these were private methods of :class:`kvcore.Backend`; the names
   :data:`DEADLINE_GRACE_S` and :class:`BackendContractError` are still importable from
   ``kvcore.backend``)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from kvcore.errors import describe
from kvcore.metrics import Metrics, OnceLogger
from kvcore.requests import BlockRequest, FailureKind, Outcome

__all__ = [
    "DEADLINE_GRACE_S",
    "BackendContractError",
    "CallGuard",
    "GuardedDataCalls",
    "answers_per_block",
    "is_count",
]

# the facade's logger: a backend's failures are logged under the name they always were
log = logging.getLogger("kvcore.backend")

#: A call that returns this much after its deadline counts as a deadline miss.
DEADLINE_GRACE_S = 0.05


class BackendContractError(AssertionError):
    """A backend returned something the contract forbids (strict mode only)."""


class CallGuard:
    """Calls one backend's hooks: fault-isolated, timed, counted, serialised if need be."""

    __slots__ = ("_serial", "closed", "failures", "metrics", "name", "strict")

    def __init__(self, name: str, metrics: Metrics, *, strict: bool, concurrent: bool) -> None:
        self.name = name
        self.metrics = metrics
        #: raise what the backend did wrong instead of counting it (a backend's own tests)
        self.strict = strict
        #: set by the facade's ``close``: from then on every data call is refused (lifecycle
        #: calls are not: ``close`` is one)
        self.closed = False
        #: each kind of failure logged once at warning level, later ones at debug
        self.failures = OnceLogger(log)
        # a backend that is not concurrent is called by one thread at a time
        self._serial: AbstractContextManager[object] = (
            nullcontext() if concurrent else threading.Lock()
        )

    def refuse_if_closed(self) -> None:
        """Raise (a caller's error, not the backend's) when the backend is closed."""
        if self.closed:
            raise RuntimeError(f"backend {self.name!r} is closed")

    def count(
        self, op: str, caller: Callable[..., Any], request: BlockRequest, kwargs: dict[str, Any]
    ) -> Outcome:
        """Call a hook that answers a block count of ``request`` (query, read, write, admit,
        flush, remove) and apply the one deadline rule to a short count."""
        self.refuse_if_closed()
        n = request.num_blocks
        t0 = time.monotonic()
        try:
            with self._serial:
                result = caller(**kwargs)
        except Exception as exc:
            if self.strict:
                raise
            return Outcome(0, *self.raised(op, exc, request, t0))
        t1 = time.monotonic()
        if result is None and op in ("flush", "remove"):
            result = 0
        if not is_count(result) or not 0 <= result <= n:
            self.invalid(op, result, f"an int in [0, {n}]", request, t1 - t0)
            return Outcome(0, f"invalid result {result!r}", FailureKind.INVALID_RESULT)
        failure = getattr(result, "failure", None)
        late = t1 > request.deadline + DEADLINE_GRACE_S
        counts = {"calls": 1, "blocks": n, "blocks_done": result, "deadline_missed": int(late)}
        if result >= n:  # the common answer: everything (no kind to work out)
            self.metrics.observe(op, t1 - t0, **counts)
            return Outcome(result)
        # a backend may say "deadline" itself (before it passes)
        kind = _kind_of(result)
        if t1 >= request.deadline and kind is not FailureKind.CORRUPT:
            # the one rule: short and at (or past) the deadline is a deadline, whatever the
            # backend called it (a timeout, a cancelled transfer, nothing at all)
            failure, kind = failure or "deadline missed", FailureKind.DEADLINE
        if failure is not None and kind is not FailureKind.DEADLINE:
            counts["failures_reported"] = 1
            self.failures.warning(
                (op, "reported"),
                "backend %r %s reported a failure (task %r): %s; counted as a miss (further "
                "reported failures are logged at debug level)",
                self.name,
                op,
                request.task_id,
                failure,
            )
        self.metrics.observe(op, t1 - t0, **counts)
        return Outcome(int(result), failure, kind) if failure else Outcome(result)

    def count_removed(self, op: str, caller: Callable[[], Any]) -> tuple[Outcome, bool]:
        """Call a hook that answers how many objects it removed, with no request to bound the
        count (``kvcore_clear``): None is 0, anything but an int >= 0 is invalid. Returns the
        count and whether the hook answered one (it may still have reported a failure with it):
        only then did the objects go."""
        self.refuse_if_closed()
        t0 = time.monotonic()
        try:
            with self._serial:
                result = caller()
        except Exception as exc:
            if self.strict:
                raise
            self.log_failure(op, exc, None)
            self.metrics.observe(op, time.monotonic() - t0, calls=1, errors=1)
            return Outcome(0, describe(exc)), False
        if result is None:
            result = 0
        if not is_count(result) or result < 0:
            msg = f"backend {self.name!r} {op} returned {result!r}; expected an int >= 0"
            if self.strict:
                raise BackendContractError(msg)
            self.log_failure(op, BackendContractError(msg), None)
            self.metrics.observe(op, time.monotonic() - t0, calls=1, invalid_results=1)
            return Outcome(0, "invalid result", FailureKind.INVALID_RESULT), False
        self.metrics.observe(op, time.monotonic() - t0, calls=1, objects_removed=result)
        failure = getattr(result, "failure", None)
        return Outcome(result, failure, _kind_of(result) if failure else None), True

    def lifecycle(self, op: str, caller: Callable[..., Any], **kwargs: Any) -> Any:
        """Call a hook outside the data path (register, stats, watch, close...): its answer,
        or None when it raised (logged once and counted as ``errors``). Not serialised, and
        allowed once closed: ``close`` itself is one."""
        try:
            return caller(**kwargs)
        except Exception as exc:
            if self.strict:
                raise
            self.log_failure(op, exc, None)
            self.metrics.add(op, errors=1)
            return None

    def ask(
        self, op: str, call: Callable[[], Any], request: BlockRequest | None
    ) -> tuple[Any, float, tuple[str, FailureKind] | None]:
        """Call a hook that answers rather than counts (contains, describe, names) as every
        hook is called: refused once closed, serialised where the backend is not concurrent,
        an exception logged once and counted (strict mode raises it). Returns the answer, the
        seconds it took, and the failure and kind when it raised (else None); the caller
        checks the answer's shape (:meth:`invalid` when it is not the contract's)."""
        self.refuse_if_closed()
        t0 = time.monotonic()
        try:
            with self._serial:
                result = call()
        except Exception as exc:
            if self.strict:
                raise
            return None, 0.0, self.raised(op, exc, request, t0)
        return result, time.monotonic() - t0, None

    def numbers(self, op: str, answer: object, prefix: str) -> dict[str, float]:
        """The entries of a hook's mapping of numbers (``kvcore_stats``) that are numbers, each
        name after ``prefix``: any other entry (a nested mapping, a bool, a string) is dropped,
        counted and logged once, never raised but in strict mode (monitoring must not fail
        because one gauge is malformed)."""
        if not isinstance(answer, Mapping):
            answer = {"(not a mapping)": answer}
        out: dict[str, float] = {}
        bad: list[object] = []
        for name, value in answer.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{prefix}{name}"] = float(value)
            else:
                bad.append(name)
        if bad:
            msg = f"backend {self.name!r} {op}: {bad} are not numbers; dropped"
            if self.strict:
                raise BackendContractError(msg)
            self.metrics.add(op, invalid_results=len(bad))
            self.failures.warning((op, "invalid"), "%s", msg)
        return out

    def raised(
        self, op: str, exc: Exception, request: BlockRequest | None, t0: float
    ) -> tuple[str, FailureKind]:
        """A hook call started at ``t0`` raised ``exc`` (not in strict mode): logged once,
        counted; its failure and kind (``deadline`` when it ended at or past the deadline)."""
        t1 = time.monotonic()
        n = 0 if request is None else request.num_blocks
        self.log_failure(op, exc, request)
        self.metrics.observe(op, t1 - t0, calls=1, errors=1, blocks=n)
        late = request is not None and t1 >= request.deadline and n > 0
        return describe(exc), FailureKind.DEADLINE if late else FailureKind.BACKEND_ERROR

    def invalid(
        self,
        op: str,
        result: object,
        expected: str,
        request: BlockRequest | None,
        seconds: float,
    ) -> None:
        """A hook answered what the contract forbids: raised in strict mode, else logged once
        and counted (the caller answers with nothing found)."""
        blocks = 0 if request is None else request.num_blocks
        asked = "" if request is None else f" for {blocks} blocks"
        msg = f"backend {self.name!r} {op} returned {result!r}{asked}; expected {expected}"
        if self.strict:
            raise BackendContractError(msg)
        self.log_failure(op, BackendContractError(msg), request)
        self.metrics.observe(op, seconds, calls=1, invalid_results=1, blocks=blocks)

    def log_failure(self, op: str, exc: BaseException, request: BlockRequest | None) -> None:
        """Log the first failure of each (op, exception type) with context; later ones at debug."""
        where = ""
        if request is not None:
            where = f" (task {request.task_id!r}, {request.num_blocks} blocks from {request.start_block})"
        kind = type(exc).__name__
        self.failures.warning(
            (op, type(exc)),
            "backend %r %s failed%s: %s; counted as a miss (further %s errors of this "
            "kind are logged at debug level)",
            self.name,
            op,
            where,
            describe(exc),
            kind,
            exc_info=exc,
        )


class GuardedDataCalls:
    """An opened backend's data hooks called through its guard, without block digests: what
    the facade calls when it keeps none, and what :class:`kvcore.integrity.BlockDigests`
    builds on (every call fault-isolated, timed and counted; ``op`` names the counters, so
    the digests' own calls are counted apart from the data's)."""

    __slots__ = ("_guard", "query_hook", "read_hook", "remove_hook", "write_hook")

    def __init__(self, guard: CallGuard, hooks: Any) -> None:
        self._guard = guard
        # pluggy's callers of the backend's hooks (``pm.hook``); a test may replace one
        self.query_hook: Callable[..., Any] = hooks.kvcore_query
        self.read_hook: Callable[..., Any] = hooks.kvcore_read
        self.write_hook: Callable[..., Any] = hooks.kvcore_write
        self.remove_hook: Callable[..., Any] = hooks.kvcore_remove

    def query(self, request: BlockRequest, op: str = "query") -> Outcome:
        return self._guard.count(op, self.query_hook, request, {"request": request})

    def read(self, request: BlockRequest, op: str = "read") -> Outcome:
        return self._guard.count(op, self.read_hook, request, {"request": request})

    def write(self, request: BlockRequest, op: str = "write") -> Outcome:
        return self._guard.count(op, self.write_hook, request, {"request": request})

    def remove(self, request: BlockRequest, op: str = "remove") -> Outcome:
        return self._guard.count(op, self.remove_hook, request, {"request": request})


def _kind_of(result: object) -> FailureKind:
    """The kind a backend gave its short count (``backend_error`` when it gave none, or one
    kvcore does not know)."""
    try:
        return FailureKind(getattr(result, "kind", None) or FailureKind.BACKEND_ERROR)
    except ValueError:
        return FailureKind.BACKEND_ERROR


def answers_per_block(result: object, n: int, valid: Callable[[Any], bool]) -> bool:
    """Whether ``result`` is one valid answer per block of an ``n``-block request."""
    return (
        isinstance(result, Sequence)
        and not isinstance(result, str | bytes)
        and len(result) == n
        and all(valid(item) for item in result)
    )


def is_count(value: object) -> bool:
    """An int (an :class:`Outcome` included) and not a bool: what every count hook returns."""
    return isinstance(value, int) and not isinstance(value, bool)
