"""The pace of a load chosen for its speed: read in short spans, cut once behind its estimate.

A load :class:`kvcore.load_costs.LoadDecider` chose carries its expected time
(:attr:`kvcore.ReadTask.expected_s`); the transfer manager reads it span by span with a
:class:`LoadPace` and stops it once it is behind, so a store that slows down mid-load costs
about the estimate, not the slow read.

.. versionadded:: 0.3
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

__all__ = [
    "CUT_GRACE_S",
    "CUT_SLACK",
    "JUDGE_SPANS",
    "LOSING_MARGIN",
    "SPAN_S",
    "SPAN_SHARE",
    "LoadPace",
]

#: a load is cut once it is this much (a fraction) behind its expected time...
CUT_SLACK = 0.5
#: ...plus this many seconds (a short load's jitter is not a slowdown)
CUT_GRACE_S = 0.02
#: a paced load reads in spans expected to take about this long, so a store that slows down
#: tenfold is noticed within ten of them (longer spans would pay a store's per-call latency
#: less often, but a span started at the old rate runs ten times its length after a tenfold
#: slowdown: 20 ms keeps that near 0.2 s)
SPAN_S = 0.02
#: ...and at most this share of the load's expected time: what the cut cannot see is the span
#: in flight, which a tenfold slowdown stretches to ten times its length, so a short load's
#: spans are shorter (a 0.43 s load's 20 ms span cost 0.2 s of a 0.69 s recompute when the
#: link slowed down under it: a quarter of the load's time is what a span may cost it)
SPAN_SHARE = 1 / 40
#: a load whose own rate says it ends this much (a fraction) past its break-even time is cut...
LOSING_MARGIN = 0.1
#: ...judged once it has read for this many spans (the first is one block, whose call latency
#: weighs little against the second's; each span judged later is read at the losing rate: at
#: 1 Gbit/s, four spans were 71 ms of a 0.67 s recompute)
JUDGE_SPANS = 2


@dataclass(frozen=True, slots=True)
class LoadPace:
    """A load of ``blocks`` blocks expected to take ``expected_s``, started at ``started``: how
    it is split into spans, and whether it is behind or losing (then cut). ``break_even_s``:
    the read time at which loading the blocks ties with recomputing them (None: unknown)."""

    expected_s: float
    blocks: int
    started: float
    break_even_s: float | None = None

    @property
    def span_s(self) -> float:
        """A span's length: :data:`SPAN_S`, or :data:`SPAN_SHARE` of a short load's time."""
        return min(SPAN_S, self.expected_s * SPAN_SHARE)

    def span_blocks(self) -> int:
        """Blocks per span at the expected rate: about :attr:`span_s` of the read, at least
        one (the first span is one block: a store slower than expected shows at once). A load
        expected within :data:`SPAN_S` reads whole."""
        if self.blocks <= 0 or self.expected_s <= SPAN_S:
            return max(1, self.blocks)
        return max(1, math.ceil(self.blocks * self.span_s / self.expected_s))

    def next_span(self, done: int, now: float | None = None) -> int:
        """Blocks of the span after ``done`` blocks were read: about :attr:`span_s` at the
        rate this load has delivered so far (the expected rate before any), at least one. A
        fast store gets few, large calls; a slow one short spans, so a slowdown shows within
        one."""
        left = self.blocks - done
        elapsed = (time.monotonic() if now is None else now) - self.started
        if done <= 0 or elapsed <= 0:
            return min(left, 1)
        return max(1, min(left, math.ceil(done / elapsed * self.span_s)))

    def behind(
        self, done: int, now: float | None = None, last: tuple[int, float] | None = None
    ) -> bool:
        """Whether, with ``done`` blocks read by ``now``, the load is behind its expected time
        by more than the slack (:data:`CUT_SLACK`, :data:`CUT_GRACE_S`): in all, or in its
        ``last`` span (blocks, seconds), so a store that slows down is left at once even by a
        load that was ahead (reading the rest at the rate it has now would take longer than
        its share of the estimate allows)."""
        elapsed = (time.monotonic() if now is None else now) - self.started
        per_block = self.expected_s / max(1, self.blocks)
        due = per_block * min(done, self.blocks)
        if elapsed > due * (1 + CUT_SLACK) + CUT_GRACE_S:
            return True
        if last is None:
            return False
        blocks, seconds = last
        return seconds > blocks * per_block * (1 + CUT_SLACK) + CUT_GRACE_S

    def losing(self, done: int, now: float | None = None) -> bool:
        """Whether the load, at the rate it has delivered since it started (``done`` blocks by
        ``now``), would read all its blocks more than :data:`LOSING_MARGIN` past its
        break-even time: the rest is then recomputed sooner than it would be read. The blocks
        already read are kept (they save their prefill whatever the rest costs), so what is
        weighed is the rest alone, and recomputing a block is taken to save the same share of
        the break-even time wherever it lies (a later block's attention makes it dearer to
        recompute: the rule errs toward cutting by that). Judged once the load has read for
        :data:`JUDGE_SPANS` spans: a probe's few reads fitted 201 MB/s on a link that
        delivered 121 MB/s, and 124-block loads estimated at 0.53 to 0.65 s took 0.80 s,
        against 0.65 to 0.69 s of recomputing; their first spans' rate showed it."""
        if self.break_even_s is None or done <= 0 or done >= self.blocks:
            return False
        elapsed = (time.monotonic() if now is None else now) - self.started
        if elapsed < JUDGE_SPANS * self.span_s:
            return False
        return elapsed / done * self.blocks > self.break_even_s * (1 + LOSING_MARGIN)
