"""What loading and computing cost now: a store's read rate and an engine's prefill rate.

Both are measured, never assumed: :class:`ReadRate` by the facade from every read it serves
(:attr:`kvcore.Backend.read_rate`), :class:`PrefillRate` by an engine adapter from its own
steps. Each is a least-squares fit of seconds over what the work was made of, with older
samples weighing less (``half_life_s``), so an estimate follows a store that slowed down within
a few seconds and falls back to "unknown" (:attr:`ReadRate.known` False) when nothing was
measured for a while, which is when :class:`kvcore.load_costs.LoadDecider` measures again.

.. versionadded:: 0.3
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

from kvcore.decaying_fit import DecayingFit

__all__ = ["DecayingFit", "PrefillRate", "PrefillStep", "ReadRate", "pair_cost_of"]

#: how far beyond the largest read measured a read rate is trusted (a factor)
EXTRAPOLATION = 8

#: the least share of the largest step timed that a prefill fit must put on its work (tokens,
#: attention) to extrapolate with it alone (:func:`_work_shown`, :func:`_bracketed`): less is
#: within the noise of timing one step (a loaded machine stretches a step by a tenth and more),
#: not a cost measured
WORK_SHOWN = 0.1

#: below this much sample weight (about one fresh sample) an estimate is "unknown"
KNOWN_WEIGHT = 0.5


class PrefillStep(NamedTuple):
    """One timed step that computed a prompt's tokens: what :meth:`PrefillRate.kept_steps`
    keeps and :meth:`PrefillRate.seed` takes (:mod:`kvcore.prefill_profile` keeps them on
    disk for the next engine). ``at``: when, in seconds since the epoch."""

    tokens: float
    pairs: float
    seconds: float
    at: float

    @property
    def size_class(self) -> tuple[int, int]:
        """Steps of about the same work (within a factor of √2 in tokens and in pairs): one
        of each is kept, the newest, so a long prefill seen once is not pushed out by the
        thousands of short steps after it."""
        return (round(2 * math.log2(max(self.tokens, 1.0))), round(2 * math.log2(self.pairs + 1)))


class ReadRate:
    """How fast one store delivers reads now: ``seconds ≈ bytes / bytes_per_s +
    per_call_s * calls``.

    Fed by :class:`kvcore.Backend` around every read it passes to the backend
    (:meth:`started`/:meth:`finished`); an adapter whose reads run in another process feeds
    what they took with :meth:`observe`. Reads that overlap share the store: what is measured
    is the store's busy time (some read in flight) against the bytes and calls it served, so N
    concurrent reads of B bytes count as N·B bytes in their common time, not as N separate
    rates. A sample is taken whenever the store goes idle, or every ``sample_s`` of continuous
    busy time. The first one of a client's life is not: its first read pays for what the
    client sets up on it (Mooncake's handshake with the segment it reads: 13 ms for a block
    that then reads in 1.3 ms, measured on loopback), which would read as latency and make a
    small probe's bandwidth look several times what the store delivers.
    """

    def __init__(
        self,
        *,
        half_life_s: float = 60.0,
        sample_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._fit = DecayingFit(2, half_life_s, clock)
        self._lock = threading.Lock()
        self._sample_s = sample_s
        self._in_flight = 0
        self._since = 0.0  # start of the busy time not yet sampled
        self._bytes = 0
        self._calls = 0
        self.samples = 0
        self._half_life_s = half_life_s
        self._largest = (0, 0.0)  # (bytes, when) of the largest sample lately
        self._smallest = (0, 0.0)  # (bytes, when) of the smallest sample lately
        self._cold = True

    @property
    def cold(self) -> bool:
        """No read came back with bytes yet: the first pays for the client's setup, no sample
        here nor where another process is told of it (:meth:`observe`). ``0.3``"""
        with self._lock:
            return self._cold

    def started(self) -> None:
        """A read was handed to the store."""
        with self._lock:
            if self._in_flight == 0:
                self._since = self._clock()
            self._in_flight += 1

    def finished(self, nbytes: int) -> None:
        """A read came back with ``nbytes`` bytes (0: nothing read, and nothing learnt of
        the store's rate beyond the time the call took)."""
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            self._bytes += nbytes
            self._calls += 1
            now = self._clock()
            busy = now - self._since
            if self._in_flight == 0 or busy >= self._sample_s:
                if self._bytes > 0 and busy > 0 and not self._cold:
                    self._add(self._bytes, self._calls, busy)
                self._cold = self._cold and self._bytes <= 0
                self._bytes = self._calls = 0
                self._since = now

    def observe(self, nbytes: int, seconds: float, calls: int = 1) -> None:
        """A read measured elsewhere: ``nbytes`` in ``seconds`` (never a client's first)."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._add(nbytes, calls, seconds)

    def _add(self, nbytes: int, calls: int, seconds: float) -> None:
        self._fit.add((nbytes, calls), seconds)
        self.samples += 1
        now = self._clock()
        largest, when = self._largest
        if nbytes >= largest or now - when > 2 * self._half_life_s:
            self._largest = (nbytes, now)
        smallest, when = self._smallest
        if smallest == 0 or nbytes <= smallest or now - when > 2 * self._half_life_s:
            self._smallest = (nbytes, now)

    def trusted_for(self, nbytes: int) -> bool:
        """Whether the fit may be extrapolated to a read of ``nbytes``: at most
        :data:`EXTRAPOLATION` times the largest read measured lately, or any size once reads of
        sizes at least twice apart were measured. Reads of one small size confound the store's
        per-call latency with its bandwidth; a rate seen only on them says little of a read a
        hundred times larger."""
        with self._lock:
            largest, when = self._largest
            smallest, _ = self._smallest
            recent = self._clock() - when <= 2 * self._half_life_s
            coef = self._fit.coefficients() if recent else None
        if not recent:
            return False
        if nbytes <= EXTRAPOLATION * largest:
            return True
        # reads of sizes at least twice apart tell latency from bandwidth (then a larger read
        # is the bandwidth's, however large) where bandwidth is a good share of the largest
        # read's time (a third at least): a fit that calls nearly all of it latency rests on a
        # difference of two times of a few milliseconds (a 6 GB/s "bandwidth" from two reads
        # of a 120 MB/s link, measured)
        if largest < 2 * smallest or coef is None:
            return False
        return bool(coef[1] <= 2 * coef[0] * largest)

    def bound_s(self, nbytes: int, *, after_free_read: int = 0) -> float | None:
        """At most how long a read of ``nbytes`` takes at the store's rate now, for a read at
        least as large as every read measured lately (None otherwise, or while unknown).

        Every second of the reads measured is counted as bandwidth: a per-call latency only
        makes a larger read relatively faster, so the bound holds however latency and
        bandwidth share the time, even from reads of one size (which cannot tell them apart,
        :meth:`trusted_for`). A decision that wins even at this bound needs no more reads to
        take. ``after_free_read``: the bound as it would be after one more read of that many
        bytes that took no time, the lowest that read could bring it (a read that could not
        make a decision win even so is not worth making).
        """
        with self._lock:
            largest, when = self._largest
            recent = self._clock() - when <= 2 * self._half_life_s
            if not recent or nbytes < largest or self._fit.weight < KNOWN_WEIGHT:
                return None
            per_byte = self._fit.slope(0, free=after_free_read)
        return None if per_byte is None else per_byte * nbytes

    def extrapolates(self, nbytes: int) -> bool:
        """Whether an estimate of a read of ``nbytes`` reaches past :data:`EXTRAPOLATION` times
        the largest read measured lately (then :meth:`estimate_s` lies between the fit and
        :meth:`bound_s`, a range as wide as the reads left latency and bandwidth unsure)."""
        with self._lock:
            largest, when = self._largest
            recent = self._clock() - when <= 2 * self._half_life_s
        return not recent or nbytes > EXTRAPOLATION * largest

    def tells_apart(self, nbytes: int) -> bool:
        """Whether a read of ``nbytes`` would tell more of latency from bandwidth than the
        reads measured lately: one at least twice the smallest or at most half the largest;
        where reads of two such sizes were measured and still left bandwidth unseen (nearly
        all latency, :meth:`trusted_for`), only one at least twice the largest (with nothing
        measured lately, no one read does)."""
        with self._lock:
            largest, when = self._largest
            smallest, _ = self._smallest
            if self._clock() - when > 2 * self._half_life_s or smallest <= 0:
                return False
        if largest >= 2 * smallest:
            return nbytes >= 2 * largest
        return nbytes >= 2 * smallest or 2 * nbytes <= largest

    @property
    def known(self) -> bool:
        """Whether enough was measured lately to estimate from."""
        with self._lock:
            return self._fit.weight >= KNOWN_WEIGHT and self._fit.coefficients() is not None

    def estimate_s(self, nbytes: int, calls: int = 1) -> float | None:
        """Seconds a read of ``nbytes`` (in ``calls`` calls) is expected to take; None unknown.

        A read more than :data:`EXTRAPOLATION` times the largest measured lately (trusted
        that far only because reads of sizes twice apart told latency from bandwidth,
        :meth:`trusted_for`) lies between the fit's extrapolation and :meth:`bound_s` (every
        second measured counted as bandwidth): the estimate is their geometric mean, the
        choice whose worst ratio over the two is least. A bandwidth fitted on reads of one
        and two blocks swings with a few milliseconds of noise: such probes in a fresh vLLM
        engine fitted 162 MB/s on a link delivering 121 MB/s (a 124-block load estimated at
        0.60 s took 0.79 s, against 0.67 s of recomputing), where the bound said 0.79 s; a
        store whose small reads are mostly latency keeps most of the fit's advantage (a
        tenfold gap between the two leaves the estimate a third of the bound)."""
        with self._lock:
            if self._fit.weight < KNOWN_WEIGHT:
                return None
            coef = self._fit.coefficients()
            largest = self._largest[0]
        if coef is None:
            return None
        fitted = float(coef[0] * nbytes + coef[1] * calls)
        if nbytes <= EXTRAPOLATION * largest:
            return fitted
        bound = self.bound_s(nbytes)
        return fitted if bound is None else _bracketed(fitted, bound)

    def figures(self) -> dict[str, float]:
        """``bytes_per_s`` and ``per_call_s`` now (empty while unknown)."""
        with self._lock:
            coef = self._fit.coefficients() if self._fit.weight >= KNOWN_WEIGHT else None
        if coef is None:
            return {}
        return {
            "bytes_per_s": 1.0 / coef[0] if coef[0] > 0 else math.inf,
            "per_call_s": float(coef[1]),
        }


class PrefillRate:
    """How fast an engine computes prompt tokens now, as a function of context length:
    ``seconds ≈ per_token_s * tokens + per_step_s * steps + per_pair_s * token_pairs``.

    ``token_pairs`` is attention's share: computing ``n`` tokens after ``c`` already in context
    attends over about ``n * (c + n / 2)`` pairs, which is what makes a long prompt's later
    tokens dearer than its first ones. The adapter feeds every step it timed
    (:meth:`observe_step`) and asks :meth:`estimate_s`; ``tokens_per_step`` is the engine's
    budget per step (vLLM's ``max_num_batched_tokens``), so a long prefill costs its steps.

    A fresh engine has timed short steps only, which say nothing of attention's cost. Two
    things stand in until the steps span the prefill asked about (its pairs within
    :data:`EXTRAPOLATION` times the most a timed step had):

    - ``pair_cost``: attention's cost per pair relative to a token's other work, from the
      model's shapes (:func:`pair_cost_of`: FLOPs per pair over FLOPs per token). The short
      steps then fit one scale for both, so a long prefill is extrapolated with its attention;
    - ``tokens_per_s``: a rate assumed until any step was timed (an operator's figure, for
      adapters that see no engine step: SGLang's and LMCache's storage layers).
    """

    def __init__(
        self,
        *,
        tokens_per_step: int | None = None,
        tokens_per_s: float | None = None,
        pair_cost: float | None = None,
        half_life_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if tokens_per_s is not None and tokens_per_s <= 0:
            raise ValueError(f"tokens_per_s must be positive, got {tokens_per_s}")
        if pair_cost is not None and pair_cost < 0:
            raise ValueError(f"pair_cost must not be negative, got {pair_cost}")
        self.tokens_per_step = tokens_per_step
        #: the rate assumed while nothing was measured (a setting: an adapter that cannot time
        #: the engine's steps, or an engine's first request)
        self.assumed_tokens_per_s = tokens_per_s
        self.pair_cost = pair_cost
        self._fit = DecayingFit(3, half_life_s, clock)
        #: per (token + pair_cost * pairs) and per step: the model's shapes fix attention's share
        self._shaped = DecayingFit(2, half_life_s, clock)
        self._most_pairs = 0.0
        self._largest = (0.0, 0.0)  # (tokens, pairs) of that step
        #: each step's seconds over what the fit expected of it just before (lately), and
        #: over those of the steps it had to extrapolate to (a fresh engine's long prefills)
        self._checked = DecayingFit(1, half_life_s, clock)
        self._checked_far = DecayingFit(1, half_life_s, clock)
        self.steps_extrapolated = 0
        self._lock = threading.Lock()
        self.samples = 0
        #: the newest prefill step of each size class (:meth:`kept_steps`)
        self._kept: dict[tuple[int, int], PrefillStep] = {}
        #: steps that came from :meth:`seed` (an earlier engine's), not timed here
        self.seeded = 0
        #: how many times :meth:`kept_steps` changed (a decode step changes nothing)
        self.kept_changes = 0

    def observe_step(self, seconds: float, batch: Iterable[tuple[int, int]]) -> None:
        """One engine step took ``seconds`` computing ``batch``: ``(tokens, context)`` per
        request (``context``: tokens already computed before this step's)."""
        tokens = pairs = 0.0
        longest = 0
        for n, context in batch:
            tokens += n
            pairs += n * (context + n / 2)
            longest = max(longest, n)
        if tokens <= 0 or seconds <= 0:
            return
        # a prefill step's estimate just before, against what it took: an operator sees
        # whether the fit is right, and above all whether its extrapolations are (a fresh
        # engine's first long prefill is estimated from its short steps only). Decode steps
        # (one token a request) are not checked: they are most steps, and the fit's solve
        # this needs (~0.1 ms) would be on every one of them
        expected, extrapolated = self._predict(tokens, pairs, 1) if longest > 1 else (None, False)
        with self._lock:
            if expected is not None and expected > 0:
                self._checked.add((expected,), seconds)
                if extrapolated:
                    self._checked_far.add((expected,), seconds)
                    self.steps_extrapolated += 1
            self._add(tokens, pairs, seconds)
            if longest > 1:
                step = PrefillStep(tokens, pairs, seconds, time.time())
                self._kept[step.size_class] = step
                self.kept_changes += 1

    def _add(self, tokens: float, pairs: float, seconds: float) -> None:
        self._fit.add((tokens, 1.0, pairs), seconds)
        if self.pair_cost is not None:
            self._shaped.add((tokens + self.pair_cost * pairs, 1.0), seconds)
        if pairs >= self._most_pairs:
            self._most_pairs, self._largest = pairs, (tokens, pairs)
        self.samples += 1

    def seed(self, steps: Iterable[PrefillStep]) -> int:
        """Start from steps another engine of the same model and settings timed on this
        machine (:class:`kvcore.prefill_profile.PrefillProfile`): a fresh engine has timed
        only short steps, whose extrapolation to a long prefill was measured 2 to 3.5 times
        too high on the CPU engine here. Seeded steps weigh as a step timed now, so this
        engine's own steps join them and, newer, soon outweigh them; they are kept (for the
        next engine) until a step of their size class is timed here. Returns how many."""
        count = 0
        with self._lock:
            for step in steps:
                if step.tokens <= 0 or step.seconds <= 0 or step.pairs < 0:
                    continue
                self._add(step.tokens, step.pairs, step.seconds)
                kept = self._kept.get(step.size_class)
                if kept is None or kept.at < step.at:
                    self._kept[step.size_class] = step
                    self.kept_changes += 1
                count += 1
            self.seeded += count
        return count

    def kept_steps(self) -> list[PrefillStep]:
        """The newest prefill step of each size class, seeded ones included, oldest first."""
        with self._lock:
            return sorted(self._kept.values(), key=lambda step: step.at)

    @property
    def known(self) -> bool:
        with self._lock:
            return self._fit.weight >= KNOWN_WEIGHT and self._fit.coefficients() is not None

    def estimate_s(self, tokens: int, context: int = 0) -> float | None:
        """Seconds to compute ``tokens`` tokens after ``context``; None while unknown."""
        if tokens <= 0:
            return 0.0
        pairs = tokens * (context + tokens / 2)
        steps = math.ceil(tokens / (self.tokens_per_step or tokens))
        return self._predict(tokens, pairs, steps)[0]

    def _predict(self, tokens: float, pairs: float, steps: int) -> tuple[float | None, bool]:
        """Seconds for this much work (None while unknown), and whether the estimate reaches
        past the steps timed (extrapolated with the model's shapes)."""
        with self._lock:
            measured = self._fit.weight >= KNOWN_WEIGHT
            coef = self._fit.coefficients() if measured else None
            spans = pairs <= EXTRAPOLATION * self._most_pairs
            shaped = (
                self._shaped.coefficients()
                if measured and not spans and self.pair_cost is not None
                else None
            )
            largest_tokens, largest_pairs = self._largest
        if shaped is not None:  # steps too short to show attention: the model's shapes do
            assert self.pair_cost is not None
            pc = self.pair_cost
            work = tokens + pc * pairs
            fitted = float(shaped[0] * work + shaped[1] * steps)
            step_s, step_work = _work_shown(
                float(shaped[0]), float(shaped[1]), largest_tokens + pc * largest_pairs
            )
            if step_s is not None:
                fitted = _bracketed(fitted, step_s * work / step_work)
            return fitted, True
        if coef is None:
            assumed = self.assumed_tokens_per_s
            return (None if assumed is None else tokens / assumed), False
        estimate = float(coef[0] * tokens + coef[1] * steps + coef[2] * pairs)
        if not spans and largest_tokens > 0:
            # (no shapes: tokens stand for the work)
            step_s, _ = _work_shown(
                float(coef[0]) + float(coef[2]) * largest_pairs / largest_tokens,
                float(coef[1]),
                largest_tokens,
            )
            if step_s is not None:
                estimate = _bracketed(estimate, step_s * tokens / largest_tokens)
        return estimate, not spans

    def figures(self) -> dict[str, float]:
        """The fitted costs now, and the rate of a 1,024-token prefill (empty while unknown);
        ``actual_vs_expected``: prefill steps' seconds over the estimate they had just before
        (lately), and ``extrapolated_actual_vs_expected`` over the steps that reached past
        every step timed before them (``steps_extrapolated`` of them): how right the first long
        prefills' estimates were, which a fresh engine's decisions rest on; ``seeded_steps``:
        the steps an earlier engine's profile seeded (:meth:`seed`)."""
        with self._lock:
            coef = self._fit.coefficients() if self._fit.weight >= KNOWN_WEIGHT else None
            checked = self._checked.coefficients()
            checked_far = self._checked_far.coefficients()
            far = self.steps_extrapolated
        if coef is None:
            return {}
        one_k = self.estimate_s(1024) or 0.0
        out = {
            "per_token_s": float(coef[0]),
            "per_step_s": float(coef[1]),
            "per_token_pair_s": float(coef[2]),
            "tokens_per_s_1k": 1024 / one_k if one_k > 0 else math.inf,
        }
        if checked is not None:
            out["actual_vs_expected"] = float(checked[0])
        if checked_far is not None and far:
            out["extrapolated_actual_vs_expected"] = float(checked_far[0])
            out["steps_extrapolated"] = float(far)
        if self.seeded:
            out["seeded_steps"] = float(self.seeded)
        return out


def _work_shown(scale: float, per_step: float, work: float) -> tuple[float | None, float]:
    """Where a prefill fit puts under :data:`WORK_SHOWN` of the largest step timed on its
    ``work`` (cost ``scale`` a unit, plus ``per_step``), that step's expected seconds and work:
    the steps timed then show no cost of the work (a fresh engine's 32-token step and decode
    step, about one step's overhead each on a CPU); else (None, work)."""
    step_s = scale * work + per_step
    if work <= 0 or step_s <= 0 or scale * work >= WORK_SHOWN * step_s:
        return None, work
    return step_s, work


def _bracketed(low: float, high: float) -> float:
    """The estimate of a long prefill that steps showing no work leave between ``low`` (the
    fit's own: the work free, the steps' overhead only) and ``high`` (every second of the
    largest step counted as work): their geometric mean. A decision that compares it with a
    load's time ``L`` then loads iff ``L * L < low * high``, the choice whose worst ratio to
    the better one over the bracket is least (the ratio is what a wrong choice costs a
    request). Measured: a 6,000-token prefill bracketed 42 ms to 4 s took 3.3 s (the fit's
    own 42 ms had a 55 ms restore recomputed); a 4,000-token one bracketed about 16 ms to
    6 s took 0.67 s (the bound alone had a 6.6 s load from a 120 Mbit/s link taken)."""
    if low <= 0:
        return high
    return math.sqrt(low * high) if high > low else low


def pair_cost_of(
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    gated_mlp: bool = True,
) -> float:
    """Attention's FLOPs per (query, key) pair over a token's FLOPs through the projections and
    the MLP, for a decoder of these shapes (the ratio :class:`PrefillRate` extrapolates with:
    on the CPU engine here, the measured cost ratio of the 6-layer bench model was within 25 %
    of it)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + (3 if gated_mlp else 2) * hidden * intermediate
    per_token = 2 * per_layer * layers
    per_pair = 4 * q * layers  # q.k and the weighted sum of v, per query head dim
    return per_pair / per_token
