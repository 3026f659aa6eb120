"""At which link rate each of bench_vllm's shaped parts runs, from what the same run measured.

The crossover where loading and recomputing take as long moves with the machine's prefill
speed, so a fixed rate (or a fixed moment to slow the link down) can land where the part no
longer tests what it says (issue 60).
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any


def crossover_rate(always_vs_recompute: dict[float, float]) -> float | None:
    """The link rate where loading and recomputing take as long, from ``always`` TTFT over
    recompute TTFT at each rate measured: interpolated in log-rate and log-ratio between the
    two neighbouring rates around 1 (the slower where several pairs cross); the measured rate
    nearest to 1 where none do; None without any."""
    points = sorted(
        (math.log(rate), math.log(ratio))
        for rate, ratio in always_vs_recompute.items()
        if rate > 0 and ratio > 0
    )
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if y0 >= 0 >= y1 and y0 != y1:
            return math.exp(x0 + (x1 - x0) * y0 / (y0 - y1))
    if not points:
        return None
    return math.exp(min(points, key=lambda p: abs(p[1]))[0])


def together_rate(setting: str, measured: dict[float, dict[str, Any]]) -> tuple[float, str]:
    """The together arm's rate: a number as given, else the crossover measured in this run
    (490 Mbit/s without the rates part)."""
    if setting != "crossover":
        return float(setting), "set (--together-rate)"
    ratios = {
        rate: statistics.median(res["always"]["ttft"]) / statistics.median(res["recompute"]["ttft"])
        for rate, res in measured.items()
    }
    found = crossover_rate(ratios)
    if found is None:
        return 490.0, "490 Mbit/s: the rates part did not run, so no crossover was measured"
    return round(found), f"the crossover measured over the rates part: {found:.0f} Mbit/s"


def slowdown_rate(setting: str, rates: list[float]) -> float:
    """The slowdown arm's rate: a number as given, else the fastest of ``rates`` (2000)."""
    if setting != "fastest":
        return float(setting)
    return max(rates, default=2000.0)


#: the slowdown cuts the link this share of the way into the always arm's TTFT measured at
#: that rate: inside the load, wherever the machine puts the crossover. A fixed 0.3 s missed
#: every load at 4 Gbit/s once the prefill got faster (loads of 0.23 s ended before the cut,
#: so the arm measured no slowdown at all)
SLOWDOWN_AT_SHARE = 1 / 3
#: the always arm slowed by the cut at least this much (TTFT against its unshaken run at the
#: same rate) shows the cut landed inside the loads; less, and the arm is flagged
SLOWDOWN_SEEN = 1.5


def slowdown_after_s(setting: str, at_rate: dict[str, Any] | None) -> tuple[float, str]:
    """When to cut the link in the slowdown arm, after the warm-up's answer, and why."""
    if setting != "measured":
        return float(setting), "set (--slowdown-after-s)"
    if at_rate is None or not at_rate["always"]["ttft"]:
        return 0.3, "0.3 s: the rates part did not measure the always arm at this rate"
    always = statistics.median(at_rate["always"]["ttft"])
    after = round(SLOWDOWN_AT_SHARE * always, 3)
    return after, f"{after} s: a third of the always arm's TTFT at this rate ({always:.3f} s)"


def storing_rate(setting: str, rates: list[float]) -> float:
    """The storing part's rate: a number as given, else the slowest of ``rates`` (490)."""
    if setting != "slowest":
        return float(setting)
    return min(rates, default=490.0)
