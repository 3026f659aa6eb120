"""Deadlines: a request whose deadline already passed returns at once (a short answer is a
``deadline`` failure), and one whose deadline passes in the middle of a large batch returns
near it with the run done so far. Also :func:`deadline_layout`, and the timing helpers of the
mid-operation test."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import ClassVar

import pytest

from kvcore.requests import BlockRequest, FailureKind
from kvcore.schemas import CacheLayout
from kvcore.testing.harness import Harness, Sequence_
from kvcore.testing.kit.fixtures import KitFixtures
from kvcore.testing.kit.marks import DATA_HOOKS, exercises

__all__ = ["DeadlineTests", "deadline_layout"]


# The mid-operation deadline test grows its batch until one full call takes this long...
_DEADLINE_TARGET_S = 0.25
# ...or until it holds this many blocks of deadline_layout() (64 MiB with both parts).
_DEADLINE_MAX_BLOCKS = 32768
# The deadline given is this fraction of the backend's own time for the whole batch...
_DEADLINE_FRACTION = 1 / 8
# ...and the call may overrun it by this fraction of that time (capped by deadline_slack_s):
# a backend that honours deadlines returns near the deadline, one that ignores them near 1.0.
_DEADLINE_OVERRUN_FRACTION = 1 / 2
# Timing on a loaded machine is noisy: a backend fails only if no attempt returns in time.
_DEADLINE_ATTEMPTS = 4


def deadline_layout(num_blocks: int = _DEADLINE_MAX_BLOCKS) -> CacheLayout:
    """Small parts (1 KiB), many blocks: the mid-operation deadline test's layout. Many small
    objects make a batch slow on any backend without needing much memory."""
    return CacheLayout(num_layers=4, num_heads=2, block_size=4, head_dim=16, num_blocks=num_blocks)


class DeadlineTests(KitFixtures):
    """Calls return by their deadline, whether it passed before the call or during it."""

    #: seconds allowed past a deadline before a call counts as hanging
    deadline_slack_s: ClassVar[float] = 2.0

    # -- deadlines -------------------------------------------------------------------------

    @exercises(*DATA_HOOKS)
    def test_expired_deadline_returns_promptly(self, harness: Harness) -> None:
        """A request whose deadline passed returns at once, and a short answer to it is a
        ``deadline`` (:class:`kvcore.FailureKind`), whatever the backend called it.

        .. versionchanged:: 0.3 the kind is checked
        """
        seq = harness.new_sequence(8)
        assert harness.write(seq) == 8
        fresh = harness.new_sequence(8)
        calls: dict[str, Callable[..., int]] = {
            "query": lambda **kw: harness.query(seq, **kw),
            "read": lambda **kw: harness.read(seq, **kw)[0],
            "write": lambda **kw: harness.write(seq, **kw),
            "write of new blocks": lambda **kw: harness.write(fresh, **kw),
        }
        for op, call in calls.items():
            t0 = time.monotonic()
            done = call(timeout_s=1e-6)
            assert time.monotonic() - t0 < self.deadline_slack_s
            assert 0 <= done <= 8
            if done < 8:
                assert getattr(done, "kind", None) == FailureKind.DEADLINE, (
                    f"an expired {op} answered {done!r} of kind {getattr(done, 'kind', None)!r}"
                )

    @exercises("kvcore_write", "kvcore_read", "kvcore_query")
    def test_deadline_expiring_mid_operation(self, open_harness: Callable[..., Harness]) -> None:
        """A deadline that passes while a large batch is in flight: the call returns near the
        deadline with the run finished so far, not when the whole batch is done.

        The batch grows until the backend's own time for it reaches a quarter second (or
        64 MiB of 1 KiB objects); the deadline is an eighth of the fastest time measured for
        the whole batch, and the call may overrun it by half that time (at most
        ``deadline_slack_s``). Up to four tries, each against the fastest time seen so far,
        so a loaded machine does not fail a backend that honours deadlines, while one that
        ignores them overruns every time: a call passes only if it stopped short of the whole
        batch. Calls run with Python's cyclic collector paused.
        """
        h = open_harness(deadline_layout())
        n = _grow_until_slow(h)
        written: list[Sequence_] = []
        try:
            self._check_deadline_overrun(h, n, "write", written)
            self._check_deadline_overrun(h, n, "read", written)
        finally:
            _remove_quietly(h, written)

    def _check_deadline_overrun(
        self, h: Harness, n: int, op: str, written: list[Sequence_]
    ) -> None:
        """Give ``op`` on ``n`` blocks a deadline at a fraction of the fastest full call seen;
        pass as soon as one call whose deadline passed mid-batch returns within the allowed
        overrun. ``written`` collects the sequences written (the reads use the first)."""
        call = h.backend.write if op == "write" else h.backend.read

        def fresh() -> Sequence_:
            if op == "read":
                return written[0]  # written in full by the write check
            written.append(h.new_sequence(n))
            return written[-1]

        # the fastest call that did the whole batch: noise (a collection, page faults on
        # fresh memory, a busy machine) only ever adds time
        done, t_full = _timed_call(h, call, h.bulk_request(fresh()))
        assert done == n, f"a {op} of {n} blocks with a {h.timeout_s} s deadline did {int(done)}"
        misses: list[str] = []
        for _ in range(_DEADLINE_ATTEMPTS):
            budget = t_full * _DEADLINE_FRACTION
            allowed = min(self.deadline_slack_s, t_full * _DEADLINE_OVERRUN_FRACTION)
            seq = fresh()
            request = replace(h.bulk_request(seq), deadline=time.monotonic() + budget)
            done, elapsed = _timed_call(h, call, request)
            assert 0 <= done <= n
            if op == "write":
                stored = h.query(seq)
                assert stored >= done, (
                    f"a write cut short by its deadline acknowledged {int(done)} blocks; a "
                    f"query right after counts {int(stored)}"
                )
            if done == n:
                # the whole batch, so no call has stopped at its deadline yet: it was faster
                # than measured (done in time), or the backend kept working past the deadline
                # (an overrun within ``allowed`` too: one fast full batch on a loaded machine,
                # where the first measure was slow, passed a backend that ignores deadlines)
                t_full = min(t_full, elapsed)
                if elapsed > budget:
                    misses.append(
                        f"{op} of {n} blocks: deadline {budget * 1e3:.1f} ms after the call, "
                        f"returned after {elapsed * 1e3:.1f} ms with the whole batch"
                    )
                continue
            if elapsed <= budget + allowed:
                return
            misses.append(
                f"{op} of {n} blocks: deadline {budget * 1e3:.1f} ms after the call, returned "
                f"after {elapsed * 1e3:.1f} ms with {int(done)} blocks (the whole batch takes "
                f"{t_full * 1e3:.1f} ms; allowed overrun {allowed * 1e3:.1f} ms)"
            )
        pytest.fail(
            "the backend kept working past the deadline: "
            + (
                "; ".join(misses)
                or f"no {op} ended after its deadline in {_DEADLINE_ATTEMPTS} tries"
            )
        )


# -- helpers ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _no_gc_pauses() -> Iterator[None]:
    """Keep Python's cyclic collector out of a timed call: in a big test process one full
    collection can take longer than the call, and it strikes calls at random."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _timed_call(
    h: Harness, call: Callable[[BlockRequest], int], request: BlockRequest
) -> tuple[int, float]:
    with _no_gc_pauses():
        t0 = time.monotonic()
        done = call(request)
        elapsed = time.monotonic() - t0
    h.release()
    return done, elapsed


def _grow_until_slow(h: Harness) -> int:
    """A batch whose write takes about the target time, or the largest one the store takes
    whole: start at 256 blocks and scale by the measured time, 2-4x a step.
    A store may refuse a batch too large for it (a short count); the last whole one is used."""
    n, whole = 256, 0
    while True:
        seq = h.new_sequence(n)
        done, elapsed = _timed_call(h, h.backend.write, h.bulk_request(seq))
        _remove_quietly(h, [seq])
        if done < n:
            assert whole, (
                f"a write of {n} fresh blocks with a {h.timeout_s} s deadline stored "
                f"{int(done)} (failure: {getattr(done, 'failure', None)!r})"
            )
            return whole
        whole = n
        if elapsed >= _DEADLINE_TARGET_S or n >= _DEADLINE_MAX_BLOCKS:
            return n
        # at most 4x a step: a backend whose cost grows faster than the batch (work per
        # slice that depends on the whole token path) must not jump far past the target
        scale = min(4.0, max(2.0, 1.5 * _DEADLINE_TARGET_S / max(elapsed, 1e-3)))
        n = min(int(n * scale), _DEADLINE_MAX_BLOCKS)


def _remove_quietly(h: Harness, seqs: list[Sequence_]) -> None:
    """Drop what a test wrote in bulk, where the backend can, so shared stores do not fill."""
    if not h.backend.implements("kvcore_remove"):
        return
    for seq in seqs:
        with contextlib.suppress(Exception):
            h.backend.remove(h.request(seq))
