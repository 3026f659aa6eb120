"""A least-squares fit of seconds over amounts of work whose older samples weigh less: what
:class:`kvcore.estimates.ReadRate` and :class:`kvcore.estimates.PrefillRate` estimate with.

.. versionadded:: 0.3
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["EXTRAPOLATION", "KNOWN_WEIGHT", "DecayingFit", "bracketed"]

#: how far beyond the largest work measured a fit is trusted alone (a factor): a read rate past
#: its largest read, a prefill rate past its longest step
EXTRAPOLATION = 8

#: below this much sample weight (about one fresh sample) an estimate is "unknown"
KNOWN_WEIGHT = 0.5


class DecayingFit:
    """``seconds ≈ Σ coef[i] * x[i]`` with non-negative coefficients, fitted by least squares
    over every sample seen, each weighing ``0.5 ** (age / half_life_s)``.

    Non-negative because every feature is an amount of work (calls, bytes, tokens): a negative
    cost would make more work look cheaper. The fit is the best one over the subsets of
    features (a handful: 2**d - 1 tiny solves), which is exact non-negative least squares for
    these sizes. Not thread-safe: its owner locks.
    """

    def __init__(self, features: int, half_life_s: float, clock: Callable[[], float]) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.half_life_s = half_life_s
        self._clock = clock
        self._xx = np.zeros((features, features))
        self._xy = np.zeros(features)
        self._yy = 0.0
        self._weight = 0.0
        self._at = clock()
        self._coef: np.ndarray | None = None
        self._subsets = [
            list(s)
            for r in range(1, features + 1)
            for s in itertools.combinations(range(features), r)
        ]

    def _decay(self) -> None:
        now = self._clock()
        factor = 0.5 ** ((now - self._at) / self.half_life_s)
        self._at = now
        if factor < 1.0:
            self._xx *= factor
            self._xy *= factor
            self._yy *= factor
            self._weight *= factor

    def add(self, x: Sequence[float], y: float) -> None:
        self._decay()
        v = np.asarray(x, dtype=np.float64)
        self._xx += np.outer(v, v)
        self._xy += v * y
        self._yy += y * y
        self._weight += 1.0
        self._coef = None

    def remove(self, x: Sequence[float], y: float, added_at: float) -> None:
        """Take back a sample :meth:`add` took at ``added_at`` (the clock's time then), with
        the weight it has now: as if it had never been added."""
        self._decay()
        w = self._weight_now(added_at)
        v = np.asarray(x, dtype=np.float64)
        self._xx -= w * np.outer(v, v)
        self._xy -= w * v * y
        self._yy = max(0.0, self._yy - w * y * y)
        self._weight = max(0.0, self._weight - w)
        self._coef = None

    def _weight_now(self, added_at: float) -> float:
        """The weight now (as of the last decay) of a sample added at ``added_at``."""
        return float(0.5 ** ((self._at - added_at) / self.half_life_s))

    def slope(
        self,
        feature: int,
        *,
        free: float = 0.0,
        without: Sequence[tuple[Sequence[float], float, float]] = (),
    ) -> float | None:
        """Seconds per unit of ``feature`` fitted on it alone (every other feature's cost
        counted as this one's); None before a sample with some of it. ``free``: as it would be
        after one more sample of that many units that took no time (the lowest one more
        sample of that size can bring it). ``without``: samples ``(x, y, added_at)`` counted
        out, as :meth:`remove` would."""
        self._decay()
        xx, xy = self._xx[feature, feature], self._xy[feature]
        for x, y, added_at in without:
            w = self._weight_now(added_at)
            xx -= w * x[feature] * x[feature]
            xy -= w * x[feature] * y
        if self._weight <= 0 or xx + free * free <= 0 or (xx <= 0 and not free):
            return None
        return float(max(0.0, xy) / (max(0.0, xx) + free * free))

    @property
    def weight(self) -> float:
        """The samples' total weight now (a fresh sample weighs 1)."""
        self._decay()
        return self._weight

    def coefficients(self) -> np.ndarray | None:
        """The fitted coefficients (None before the first sample)."""
        if self._weight <= 0:
            return None
        if self._coef is None:
            self._coef = self._solve()
        return self._coef

    def _solve(self) -> np.ndarray:
        d = len(self._xy)
        best, best_err = np.zeros(d), math.inf
        # Features come in the order they are trusted alone (bytes before calls, tokens before
        # steps): one sample is explained by the first. They differ by many orders of magnitude (calls against bytes): solve on columns
        # scaled to unit size. A tiny ridge keeps a subset the samples cannot tell apart
        # solvable. Subsets go from the fewest features up (in feature order), and a larger one
        # is taken only when it fits clearly better: from two short steps, a per-step and a
        # per-token cost explain everything, and extrapolating them is safer than a made-up
        # quadratic term.
        scale = np.sqrt(np.maximum(np.diag(self._xx), 1e-300))
        xx = self._xx / np.outer(scale, scale)
        xy = self._xy / scale
        tolerance = 1e-9 * max(self._yy, 1e-30)
        for subset in self._subsets:
            a = xx[np.ix_(subset, subset)] + 1e-10 * np.eye(len(subset))
            try:
                sol = np.linalg.solve(a, xy[subset])
            except np.linalg.LinAlgError:
                continue
            if (sol < 0).any():
                continue
            scaled = np.zeros(d)
            scaled[subset] = sol
            err = self._yy - 2 * scaled @ xy + scaled @ xx @ scaled
            if err < best_err - tolerance:
                best, best_err = scaled / scale, err
        return best


def bracketed(low: float, high: float) -> float:
    """An estimate that what was measured leaves between ``low`` and ``high`` (a long
    prefill's, between the fit's own, the work free, and every second of the largest step
    counted as work; a long read's, between the fit's and every second measured counted as
    bandwidth): their geometric mean. A decision that compares it with a
    load's time ``L`` then loads iff ``L * L < low * high``, the choice whose worst ratio to
    the better one over the bracket is least (the ratio is what a wrong choice costs a
    request). Measured: a 6,000-token prefill bracketed 42 ms to 4 s took 3.3 s (the fit's
    own 42 ms had a 55 ms restore recomputed); a 4,000-token one bracketed about 16 ms to
    6 s took 0.67 s (the bound alone had a 6.6 s load from a 120 Mbit/s link taken)."""
    if low <= 0:
        return high
    return math.sqrt(low * high) if high > low else low
