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

from kvcore.decaying_fit import EXTRAPOLATION, KNOWN_WEIGHT, DecayingFit, bracketed
from kvcore.read_rate import ReadRate

__all__ = ["DecayingFit", "PrefillRate", "PrefillStep", "ReadRate", "pair_cost_of"]

#: the least share of the largest step timed that a prefill fit must put on its work (tokens,
#: attention) to extrapolate with it alone (:func:`_work_shown`,
#: :func:`kvcore.decaying_fit.bracketed`): less is within the noise of timing one step (a loaded machine stretches a step by a tenth and more),
#: not a cost measured
WORK_SHOWN = 0.1


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
                fitted = bracketed(fitted, step_s * work / step_work)
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
                estimate = bracketed(estimate, step_s * tokens / largest_tokens)
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
