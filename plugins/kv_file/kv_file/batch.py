"""A batch's objects fanned out over the I/O threads, and the answer their outcomes add up to.

Each object of a request (flat ``[block][part]`` order) is one call of the backend's per-object
job, which returns its outcome: a counter name (``read_hits``, ``write_stored``, ...). The
calling thread works too; batches smaller than :data:`INLINE_BYTES` run in it alone.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable

import kvcore
from kv_file.files import describe
from kv_file.objio import ReadOutcome
from kvcore import BlockRequest, Outcome, leading_run
from kvcore.fileio import FileBatch
from kvcore.threads import thread_pool

__all__ = ["FAILURES", "GOOD", "INLINE_BYTES", "READ_COUNTERS", "Batches", "answer"]

#: Batches smaller than this run in the calling thread: a thread hand-off costs more.
INLINE_BYTES = 1 << 20

READ_COUNTERS = {
    ReadOutcome.OK: "read_hits",
    ReadOutcome.MISSING: "read_missing",
    ReadOutcome.WRONG_SIZE: "read_wrong_size",
    ReadOutcome.MISNAMED: "read_misnamed",
    ReadOutcome.FOREIGN: "foreign_removed",
    ReadOutcome.CORRUPT: "corrupt_removed",
}
#: Per-object outcomes that store or find the object.
GOOD = frozenset(("read_hits", "write_stored", "write_skipped"))
#: Per-object outcomes that are failures rather than absence (reported in ``Outcome.failure``).
FAILURES = {
    "io_errors": "I/O error",
    "write_errors": "write failed",
    "corrupt_removed": "corrupt object (checksum mismatch), removed",
}


class Batches:
    """Runs batches on a pool of ``io_threads`` threads; counts every object's outcome in
    ``counters`` and logs each kind of failure once through ``failures``."""

    def __init__(
        self, io_threads: int, counters: kvcore.Counters, failures: kvcore.OnceLogger
    ) -> None:
        self._pool = thread_pool(io_threads, "kv_file-io")
        self._counters = counters
        self._failures = failures

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def run(
        self,
        request: BlockRequest,
        one: Callable[[int], str],
        nbytes: tuple[int, ...],
        workers: int,
        error_outcome: str,
    ) -> tuple[list[str], dict[int, OSError]]:
        """Call ``one(k)`` for every object ``k`` (flat ``[block][part]`` order) in parallel.

        Workers pull the next object from a shared counter, stop at the deadline, and skip
        objects past the first failed block (they could not count). The call returns only
        when no worker touches the caller's buffers any more: abandoning in-flight I/O would
        let it write into memory the caller already reuses. Each worker finishes at most the
        one object it holds when the deadline passes. Returns every object's outcome, and the
        error of each one that raised (its outcome is then ``error_outcome``).
        """
        parts = len(request.parts)
        total = request.num_blocks * parts
        outcomes = ["skipped"] * total
        errors: dict[int, OSError] = {}
        if total == 0:
            return outcomes, errors
        counter = itertools.count()
        stop = [total]  # objects from here on cannot count: their block or an earlier failed
        deadline = request.deadline
        clock = time.monotonic

        def worker() -> None:
            for k in counter:
                if k >= stop[0]:
                    return
                if clock() >= deadline:
                    outcomes[k] = "deadline"
                    stop[0] = min(stop[0], k - k % parts)
                    return
                try:
                    outcome = one(k)
                except OSError as exc:
                    errors[k] = exc
                    outcome = error_outcome
                    self.failed(error_outcome, exc, request.object_names[k // parts][k % parts])
                outcomes[k] = outcome
                if outcome not in GOOD:
                    stop[0] = min(stop[0], k - k % parts)

        self._on_threads(worker, min(workers, total), sum(nbytes) * request.num_blocks)
        self.count(outcomes)
        return outcomes, errors

    def run_native(self, batch: FileBatch, workers: int, nbytes: int) -> None:
        """Run a native batch of ``nbytes`` on ``workers`` threads (the caller's included);
        returns when no thread works on it any more (its results are then complete)."""
        self._on_threads(batch.run, min(workers, batch.size), nbytes)

    def _on_threads(self, work: Callable[[], None], workers: int, nbytes: int) -> None:
        if workers <= 1 or nbytes < INLINE_BYTES:
            work()
            return
        futures = [self._pool.submit(work) for _ in range(workers - 1)]
        try:
            work()
        finally:
            for f in futures:
                f.result()

    def count(self, outcomes: list[str]) -> None:
        """Count a batch's outcomes (objects never started aside)."""
        for outcome, count in Counter(o for o in outcomes if o != "skipped").items():
            self._counters.add(outcome, count)

    def failed(self, error_outcome: str, exc: OSError, name: str) -> None:
        """Log an object's failure, once per kind of failure (then at debug level)."""
        self._failures.warning(
            (error_outcome, exc.errno),
            "kv_file %s of %r failed: %s (further errors like it are logged at debug level)",
            "write" if error_outcome == "write_errors" else "read",
            name,
            describe(exc),
        )


def answer(outcomes: list[str], errors: dict[int, OSError], parts: int) -> int:
    """The leading run, as an Outcome that says why when a failure (not absence) ended it."""
    n = leading_run([o in GOOD for o in outcomes], parts)
    for k in range(n * parts, min((n + 1) * parts, len(outcomes))):
        why = FAILURES.get(outcomes[k])
        if why is not None:
            exc = errors.get(k)
            return Outcome(n, f"{why}: {describe(exc)}" if exc is not None else why)
    return n
