"""benchmarks/RESULTS.md shows one chart per benchmark report, each drawn from its JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_report_has_its_chart_in_results_md():
    reports = sorted(p.stem for p in (BENCH / "results").glob("*.json"))
    assert len(reports) >= 6
    linked = re.findall(
        r"^!\[(\w+)\]\(charts/(\w+)\.png\)$", (BENCH / "RESULTS.md").read_text(), re.M
    )
    assert sorted(name for name, _ in linked) == reports
    for name, stem in linked:
        assert name == stem
        assert (BENCH / "charts" / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"


def test_every_report_has_the_benchmark_report_shape():
    for path in (BENCH / "results").glob("*.json"):
        report = json.loads(path.read_text())
        assert {"figures", "ratios", "goals"} <= set(report), path
        assert set(report["goals"]) <= set(report["ratios"]), path  # a goal belongs to a ratio
