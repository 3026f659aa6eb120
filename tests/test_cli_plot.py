"""Charts: ``kvcore bench --plot FILE.png`` and ``benchmarks/plot_results.py`` on reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import kvcore_cli

from kvcore.cli.errors import ExitCode
from kvcore.cli.plot import parse_goal, unit_of

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytest.importorskip("matplotlib", reason="the plot extra (pip install -e '.[plot]')")


def test_bench_plot_draws_a_png(tmp_path):
    chart = tmp_path / "bench.png"
    out = kvcore_cli(
        "bench", "--backend", "memory", "--blocks", "1", "--repeats", "1", "--plot", str(chart)
    )
    assert out.returncode == 0, out.stderr
    assert f"chart: {chart}" in out.stdout
    assert chart.read_bytes()[:8] == PNG_MAGIC and chart.stat().st_size > 10_000


def test_bench_plot_without_matplotlib_fails_before_measuring(tmp_path):
    site = tmp_path / "site"
    (site / "matplotlib").mkdir(parents=True)
    (site / "matplotlib" / "__init__.py").write_text("raise ImportError('not installed here')\n")
    out = kvcore_cli("bench", "--backend", "memory", "--plot", str(tmp_path / "x.png"), site=site)
    assert out.returncode == ExitCode.MISSING_DEPENDENCY, out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[0] == (
        "kvcore: error: drawing charts needs matplotlib: pip install 'kvcore[plot]'"
    )
    assert "steps" not in out.stderr  # no progress: nothing was measured


def test_bench_plot_to_an_unwritable_path_is_a_usage_error(tmp_path):
    out = kvcore_cli(
        "bench", "--backend", "memory", "--blocks", "1", "--repeats", "1",
        "--plot", str(tmp_path / "no" / "such" / "dir" / "x.png"),
    )  # fmt: skip
    assert out.returncode == ExitCode.USAGE, out.stderr
    assert "cannot write the chart" in out.stderr
    assert "steps" not in out.stderr  # refused before measuring


REPORTS = {
    "bench_file": {
        "figures": {
            "file_write_gbps": 6.36,
            "raw_write_gbps": 4.81,
            "file_read_warm_gbps": 12.9,
            "raw_read_warm_gbps": 12.3,
            "query_10k_keys_ms": 1.9,
        },
        "ratios": {"write_vs_raw": 1.32, "read_warm_vs_raw": 1.05, "query_10k_keys_vs_5ms": 0.39},
        "goals": {"write_vs_raw": ">= 0.9", "read_warm_vs_raw": ">= 1.0"},
    },
    "bench_dispatch": {
        "figures": {"query_64_direct_us": 0.09, "query_64_through_kvcore_us": 3.5},
        "ratios": {"query_64_overhead_us_vs_goal": 0.17},
        "goals": {"query_64_overhead_us_vs_goal": "<= 1.0 (overhead <= 20 us)"},
    },
}


def test_plot_results_draws_one_chart_per_report(tmp_path):
    paths = []
    for name, report in REPORTS.items():
        path = tmp_path / f"{name}.json"
        # what `python benchmarks/x.py --json > x.json` leaves, log lines included
        path.write_text("INFO something logged first\n" + json.dumps(report) + "\n")
        paths.append(str(path))
    out_dir = tmp_path / "charts"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plot_results.py"), *paths, "--out-dir",
         str(out_dir), "--markdown"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    for name in REPORTS:
        chart = out_dir / f"{name}.png"
        assert chart.read_bytes()[:8] == PNG_MAGIC
        assert f"![{name}](" in run.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("not a report\n")
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plot_results.py"), str(bad)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1 and "no JSON object with 'figures'" in run.stderr


def test_goal_and_unit_parsing():
    assert parse_goal(">= 0.9") == (">=", 0.9)
    assert parse_goal("<= 1.0 (overhead <= 20 us)") == ("<=", 1.0)
    assert parse_goal("fast") is None
    assert unit_of("read_gbps") == "GB/s" and unit_of("query_ms") == "ms"
    assert unit_of("overhead_us") == "µs" and unit_of("blocks") is None
