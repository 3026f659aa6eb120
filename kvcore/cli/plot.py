"""Charts of benchmark reports (``{"figures", "ratios", "goals"}``), for ``kvcore bench --plot``
and ``benchmarks/plot_results.py``. Needs matplotlib: ``pip install 'kvcore[plot]'``.

A chart has two panels: the figures of the report's main unit (GB/s when it has any), kvcore's
and the baselines' side by side, and the ratios against their baselines with each goal drawn
as a mark, so a reader sees at once which goal is met.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcore.cli.errors import CliError, ExitCode

__all__ = ["parse_goal", "plot_report", "require_matplotlib", "unit_of"]

#: figure-name suffixes and the unit they stand for, most telling first
UNITS = {"_gbps": "GB/s", "_ms": "ms", "_us": "µs", "_s": "s"}
#: names of baseline figures in the benchmarks' reports (drawn grey): the raw store or client,
#: a device's measured limit, a plain copy, a stage measured alone, a call made directly,
#: stages run at once by hand
BASELINE = re.compile(
    r"^(raw|limit|memcpy|np_copyto|gather|scatter|backend)_|_(direct|alone|baseline|by_hand)_"
    r"|serial_combination|_side_by_side_"
)
_GOAL = re.compile(r"^\s*(<=|>=|<|>|==)\s*([0-9.]+)")


def require_matplotlib() -> Any:
    """Import matplotlib with a file-only backend, or fail with the install hint."""
    try:
        import matplotlib
    except ImportError:
        raise CliError(
            "drawing charts needs matplotlib: pip install 'kvcore[plot]'",
            ExitCode.MISSING_DEPENDENCY,
        ) from None
    matplotlib.use("Agg")  # no display needed, and none is touched
    return matplotlib


def unit_of(name: str) -> str | None:
    for suffix, unit in UNITS.items():
        if name.endswith(suffix):
            return unit
    return None


def parse_goal(goal: str) -> tuple[str, float] | None:
    """``">= 0.9"`` -> ``(">=", 0.9)``; None when the goal is not a comparison with a number."""
    m = _GOAL.match(str(goal))
    return (m.group(1), float(m.group(2))) if m else None


def _value(entry: Any) -> tuple[float, float, float] | None:
    """(median, min, max) of a figure or ratio: a plain number, or a spread
    ``{"median", "min", "max"}`` as the benchmarks report them; None for anything else."""
    if isinstance(entry, bool):
        return None
    if isinstance(entry, (int, float)):
        return float(entry), float(entry), float(entry)
    if isinstance(entry, Mapping) and isinstance(entry.get("median"), (int, float)):
        return (
            float(entry["median"]),
            float(entry.get("min", entry["median"])),
            float(entry.get("max", entry["median"])),
        )
    return None


def _main_unit(figures: Mapping[str, Any]) -> str | None:
    counts: dict[str, int] = {}
    for name, value in figures.items():
        unit = unit_of(name)
        if unit is not None and _value(value) is not None:
            counts[unit] = counts.get(unit, 0) + 1
    if not counts:
        return None
    return "GB/s" if "GB/s" in counts else max(counts, key=lambda u: counts[u])


def _label(name: str) -> str:
    for suffix in UNITS:
        name = name.removesuffix(suffix)
    return name.replace("_", " ")


def plot_report(report: Mapping[str, Any], path: str | Path, title: str | None = None) -> Path:
    """Draw ``report`` into ``path`` (PNG, or any format matplotlib infers from the suffix)."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    figures = report.get("figures", {})
    ratios = {k: v for k, v in ((k, _value(v)) for k, v in report.get("ratios", {}).items()) if v}
    goals = report.get("goals", {})
    unit = _main_unit(figures)
    shown = {
        k: v
        for k, v in ((k, _value(v)) for k, v in figures.items())
        if v is not None and unit is not None and unit_of(k) == unit
    }
    panels = [p for p in (shown, ratios) if p]
    if not panels:
        raise CliError("the report has no figures or ratios to draw", ExitCode.USAGE)
    height = max(2.5, 0.32 * max(len(p) for p in panels) + 1.2)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), height), squeeze=False)
    col = 0
    if shown:
        ax = axes[0][col]
        names = list(shown)
        colours = ["#9e9e9e" if BASELINE.search(n) else "#1f77b4" for n in names]
        _bars(ax, [_label(n) for n in names], [shown[n] for n in names], colours)
        ax.set_xlabel(unit)
        ax.set_title(f"figures ({unit}; grey: baselines; whiskers: min-max)", fontsize=10)
        col += 1
    if ratios:
        ax = axes[0][col]
        names = list(ratios)
        met = []
        for n in names:
            goal = parse_goal(goals.get(n, ""))
            met.append(None if goal is None else _meets(ratios[n][0], *goal))
        colours = ["#2ca02c" if m else "#d62728" if m is False else "#1f77b4" for m in met]
        _bars(ax, [_label(n) for n in names], [ratios[n] for n in names], colours)
        for i, n in enumerate(names):
            goal = parse_goal(goals.get(n, ""))
            if goal is not None:
                ax.plot([goal[1], goal[1]], [i - 0.4, i + 0.4], color="black", linewidth=2)
        ax.axvline(1.0, color="#bbbbbb", linewidth=0.8, linestyle="--")
        ax.set_xlabel("ratio (black mark: goal; green met, red missed)")
        ax.set_title("ratios against same-run baselines", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out = Path(path)
    try:
        fig.savefig(out, dpi=110)
    except OSError as exc:
        raise CliError(f"cannot write the chart {str(out)!r}: {exc}", ExitCode.USAGE) from None
    finally:
        plt.close(fig)
    return out


def _bars(
    ax: Any, labels: list[str], values: list[tuple[float, float, float]], colours: list[str]
) -> None:
    """Horizontal bars at the medians, whiskers from min to max where they differ."""
    medians = [v[0] for v in values]
    low = [v[0] - v[1] for v in values]
    high = [v[2] - v[0] for v in values]
    spread = any(lo or hi for lo, hi in zip(low, high, strict=True))
    ax.barh(labels, medians, color=colours, xerr=[low, high] if spread else None, capsize=3)
    ax.invert_yaxis()


def _meets(value: float, op: str, bound: float) -> bool:
    return {
        "<=": value <= bound,
        ">=": value >= bound,
        "<": value < bound,
        ">": value > bound,
        "==": value == bound,
    }[op]
