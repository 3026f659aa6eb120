"""What a load-or-recompute decider chose and what then happened, as the figures an operator
reads (``kvcore stats``, Prometheus): decisions by reason, loads taken and declined, the
seconds expected against the seconds loads took.

:class:`kvcore.load_costs.LoadDecider` decides; this module only counts, so the accounting
has one home whichever way a decision was reached.

.. versionadded:: 0.3
"""

from __future__ import annotations

import math
import threading

from kvcore.estimates import PrefillRate
from kvcore.load_choice import LoadChoice
from kvcore.metrics import Counters
from kvcore.read_rate import ReadRate

__all__ = ["LoadFigures"]


class LoadFigures:
    """The counters of one decider and the mean of actual over expected load seconds.
    Thread-safe."""

    def __init__(self) -> None:
        self.counters = Counters()
        self._lock = threading.Lock()
        self._ratio_sum = 0.0  # actual / expected load seconds, over settled loads
        self._ratio_n = 0

    def chosen(self, choice: LoadChoice) -> LoadChoice:
        """Count a decision (returned, so a caller counts as it returns it)."""
        c = self.counters
        c.add("decisions")
        c.add(f"decisions_{choice.why}")
        if choice.blocks:
            c.add("loads_taken")
            c.add("blocks_loaded", choice.blocks)
            c.add("expected_load_s", choice.expected_s)
            c.add("expected_saved_s", choice.saved_s)
        else:
            c.add("loads_declined")
        if choice.declined:
            c.add("blocks_declined", choice.declined)
        return choice

    def settle(self, choice: LoadChoice, actual_s: float, blocks_done: int) -> None:
        """See :meth:`kvcore.load_costs.LoadDecider.settle`."""
        if choice.blocks <= 0:
            return
        c = self.counters
        c.add("loads_settled")
        c.add("settled_expected_s", choice.expected_s)
        c.add("settled_actual_s", actual_s)
        if blocks_done < choice.blocks:
            c.add("loads_short")
            c.add("blocks_short", choice.blocks - blocks_done)
        if choice.expected_s > 0:
            with self._lock:
                self._ratio_sum += actual_s / choice.expected_s
                self._ratio_n += 1

    def cut(self, blocks: int) -> None:
        """See :meth:`kvcore.load_costs.LoadDecider.cut`."""
        self.counters.add("loads_cut")
        self.counters.add("blocks_cut", blocks)

    def snapshot(self, prefill: PrefillRate, rate: ReadRate | None = None) -> dict[str, float]:
        """See :meth:`kvcore.load_costs.LoadDecider.stats`."""
        out = self.counters.snapshot()
        with self._lock:
            if self._ratio_n:
                out["load_actual_vs_expected"] = self._ratio_sum / self._ratio_n
        if rate is not None:
            out.update({f"read_{k}": v for k, v in rate.figures().items()})
        out.update({f"prefill_{k}": v for k, v in prefill.figures().items()})
        return {k: v for k, v in out.items() if math.isfinite(v)}
