"""What every benchmark here shares: the layout arguments, repetitions and the report format.

A figure is every repetition's value, reported as its median and spread; a ratio is computed
per repetition from the two contenders measured side by side in that repetition (paired,
alternated), then summarised the same way. A ratio against a baseline named as the limit that
comes out above 1.05 is flagged in the report: the baseline was not the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: a contender this much faster than a baseline named the limit means the baseline is wrong
LIMIT_TOLERANCE = 1.05

REPO = Path(__file__).resolve().parents[1]
#: the vLLM adapter's venv (created by integrations/vllm/scripts/test.sh)
VLLM_VENV = REPO / "integrations" / "vllm" / ".venv"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"


def python_with_vllm(benchmark: str) -> None:
    """Re-execute the running benchmark with the vLLM venv's Python when this one cannot
    import vLLM and kvcore-vllm; exit naming what to run when there is no such venv.

    Call it before anything starts a thread (found, not imported: importing vLLM starts
    threads, and some benchmarks enter a network namespace first)."""
    import importlib.util

    if importlib.util.find_spec("vllm") and importlib.util.find_spec("kvcore_vllm"):
        return
    # venvs' pythons are symlinks to one interpreter: compare the environments, not them
    if VLLM_PYTHON.exists() and Path(sys.prefix).resolve() != VLLM_VENV.resolve():
        os.execv(str(VLLM_PYTHON), [str(VLLM_PYTHON), *sys.argv])
    sys.exit(
        f"{benchmark} needs vLLM and kvcore-vllm: run integrations/vllm/scripts/test.sh once "
        f"to create {VLLM_PYTHON}"
    )


def spread(values: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """``{"median", "min", "max", "n"}`` of ``values``."""
    vals = [float(v) for v in values]
    return {
        "median": round(statistics.median(vals), digits),
        "min": round(min(vals), digits),
        "max": round(max(vals), digits),
        "n": len(vals),
    }


class Report:
    """Figures and ratios, each kept per repetition and reported with its spread."""

    def __init__(self) -> None:
        self.figures: dict[str, dict[str, Any]] = {}
        self.ratios: dict[str, dict[str, Any]] = {}
        self.goals: dict[str, str] = {}
        self.notes: dict[str, Any] = {}
        self.flags: list[str] = []
        self.limits: list[str] = []  # ratios whose baseline is named as the physical limit

    def figure(self, name: str, values: Sequence[float], unit: str) -> None:
        self.figures[name] = {**spread(values), "unit": unit}

    def ratio(
        self,
        name: str,
        numerators: Sequence[float],
        denominators: Sequence[float],
        *,
        goal: str | None = None,
        limit: bool = False,
    ) -> None:
        """``numerators[i] / denominators[i]`` per repetition. ``limit``: the denominator is
        named as the physical limit; a median above :data:`LIMIT_TOLERANCE` is flagged."""
        values = [n / d for n, d in zip(numerators, denominators, strict=True)]
        self.ratios[name] = spread(values)
        if goal is not None:
            self.goals[name] = goal
        if limit:
            self.limits.append(name)
        if limit and self.ratios[name]["median"] > LIMIT_TOLERANCE:
            self.flags.append(
                f"baseline defect: {name} = {self.ratios[name]['median']} > {LIMIT_TOLERANCE}: "
                "the contender beat the baseline named as the limit"
            )

    def as_dict(self, **extra: Any) -> dict[str, Any]:
        return {
            "figures": self.figures,
            "ratios": self.ratios,
            "goals": self.goals,
            "flags": self.flags,
            "limits": self.limits,
            **self.notes,
            **extra,
            "machine": machine(),
        }


def check_report(report: dict[str, Any], min_n: int = 2) -> None:
    """Raise ``AssertionError`` naming the entry unless ``report`` has the shape every benchmark
    here promises: each figure and ratio a spread of at least ``min_n`` values (figures with a
    unit), goals only for ratios it reports, limits a subset of its ratios, flags a list."""
    for section in ("figures", "ratios"):
        entries = report.get(section)
        assert isinstance(entries, dict) and entries, f"{section}: missing or empty"
        for name, value in entries.items():
            assert isinstance(value, dict), f"{section}.{name}: a bare number, not a spread"
            missing = {"median", "min", "max", "n"} - set(value)
            assert not missing, f"{section}.{name}: missing {sorted(missing)}"
            assert value["n"] >= min_n, f"{section}.{name}: n={value['n']} < {min_n}"
            assert value["min"] <= value["median"] <= value["max"], f"{section}.{name}: {value}"
            if section == "figures":
                assert value.get("unit"), f"figures.{name}: no unit"
    ratios = report["ratios"]
    assert set(report.get("goals", {})) <= set(ratios), "goals: names a ratio not reported"
    assert set(report.get("limits", [])) <= set(ratios), "limits: names a ratio not reported"
    assert isinstance(report.get("flags"), list), "flags: missing"


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_1m": round(os.getloadavg()[0], 2),
    }


def add_layout_args(ap: argparse.ArgumentParser, blocks: int, blocks_help: str = "") -> None:
    """The typical layout (28 layers x 8 heads x 64 tokens x 128 dim) and a block count."""
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=blocks, help=blocks_help or "blocks per call")


def emit(report: dict[str, Any], as_json: bool) -> None:
    """One JSON object on stdout, or the same figures as aligned text for a person."""
    if as_json:
        print(json.dumps(report))
        return
    goals = report.get("goals", {})
    for name, value in report["figures"].items():
        print(f"{name:40s} {_text(value)}")
    for name, value in report["ratios"].items():
        print(f"{name:40s} {_text(value)}  (goal {goals.get(name, '-')})")
    for flag in report.get("flags", []):
        print(f"FLAG: {flag}")


def _text(value: Any) -> str:
    if isinstance(value, dict) and "median" in value:
        unit = f" {value['unit']}" if value.get("unit") else ""
        return f"{value['median']}{unit} [{value['min']} - {value['max']}]"
    return str(value)
