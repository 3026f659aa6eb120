"""bench_vllm's shaped part picks its together and slowdown rates from what the same run
measured (issue 60): the crossover where loading and recomputing take as long moves with the
machine's prefill speed, so a fixed rate can land where the arm no longer tests what it says."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from benchutil import Report
from shaped_rates import (
    crossover_rate,
    slowdown_after_s,
    slowdown_rate,
    storing_rate,
    together_rate,
)
from vllm_shaped import _report_slowdown

#: always / recompute TTFT medians measured in session 70 (the 4,000-token prompt, 0.66 s to
#: recompute): the crossover lies between 1 and 2 Gbit/s
SESSION_70 = {120: 9.95, 240: 5.03, 490: 2.45, 1000: 1.257, 2000: 0.694}


def test_the_crossover_is_interpolated_in_log_rate_between_the_rates_around_it() -> None:
    found = crossover_rate(SESSION_70)
    assert found is not None
    x = math.log(1.257) / (math.log(1.257) - math.log(0.694))
    assert found == pytest.approx(1000 * 2**x)
    assert 1000 < found < 2000


def test_a_ratio_of_one_at_a_measured_rate_is_that_rate() -> None:
    assert crossover_rate({490: 1.6, 1000: 1.0, 2000: 0.5}) == pytest.approx(1000)


def test_without_a_crossing_the_nearest_rate_stands_in_and_nothing_gives_none() -> None:
    assert crossover_rate({120: 4.0, 490: 1.5, 1000: 1.2}) == pytest.approx(1000)
    assert crossover_rate({1000: 0.8, 2000: 0.4}) == pytest.approx(1000)
    assert crossover_rate({}) is None


def test_the_together_rate_is_the_measured_crossover_unless_set() -> None:
    measured = {
        rate: {"always": {"ttft": [ratio]}, "recompute": {"ttft": [1.0]}}
        for rate, ratio in SESSION_70.items()
    }
    rate, why = together_rate("crossover", measured)
    assert rate == round(crossover_rate(SESSION_70) or 0)
    assert "crossover" in why
    assert together_rate("crossover", {})[0] == 490.0
    assert together_rate("750", measured) == (750.0, "set (--together-rate)")


def test_the_slowdown_rate_is_the_fastest_measured_unless_set() -> None:
    assert slowdown_rate("fastest", [120, 2000, 490]) == 2000
    assert slowdown_rate("fastest", []) == 2000.0
    assert slowdown_rate("1000", [120, 2000]) == 1000.0


def test_the_storing_rate_is_the_slowest_measured_unless_set() -> None:
    """Where a save takes longest, the most compute runs beside it."""
    assert storing_rate("slowest", [2000, 240, 490]) == 240
    assert storing_rate("slowest", []) == 490.0
    assert storing_rate("1000", [120, 2000]) == 1000.0


def test_the_slowdown_cuts_a_third_into_the_always_load_measured_at_that_rate() -> None:
    """Session 77: with a fixed 0.3 s, 4 Gbit/s loads of 0.23 s ended before the cut."""
    at_4g = {"always": {"ttft": [0.252, 0.253, 0.267]}}
    after, why = slowdown_after_s("measured", at_4g)
    assert after == pytest.approx(0.253 / 3, abs=1e-3)
    assert "always" in why
    assert slowdown_after_s("measured", None)[0] == 0.3
    assert slowdown_after_s("0.5", at_4g) == (0.5, "set (--slowdown-after-s)")


def _arms(always: list[float]) -> dict[str, dict[str, object]]:
    return {
        name: {"ttft": ttft, "cached": [0], "same": True, "metrics": [{}]}
        for name, ttft in (("recompute", [0.5]), ("always", always), ("auto", [0.3]))
    }


def test_a_slowdown_that_missed_the_loads_is_flagged() -> None:
    unshaken = {"always": {"ttft": [0.25]}}
    missed = Report()
    _report_slowdown(missed, 4000, _arms([0.26]), unshaken)
    assert any("no slowdown was measured" in flag for flag in missed.flags)
    hit = Report()
    _report_slowdown(hit, 4000, _arms([1.2]), unshaken)
    assert hit.flags == []
    assert hit.ratios["shaped_slowdown_4000mbit_always_vs_unshaken"]["median"] == pytest.approx(4.8)
