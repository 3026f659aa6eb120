"""``benchmarks/bench_sglang.py`` runs in this venv and reports what issue 28 asks of every
benchmark: each figure and ratio as its median and range over ``--reps`` repetitions (ratios
paired per repetition), goals naming only ratios reported. Tiny sizes: speeds are the
benchmark's business, the report's shape is this test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))
from benchutil import check_report  # noqa: E402


def test_bench_sglang_reports_median_and_spread(tmp_path: Path) -> None:
    command = [
        sys.executable, str(BENCH / "bench_sglang.py"), "--json", "--reps", "2", "--pages", "2",
        "--layers", "2", "--dir", str(tmp_path),
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    check_report(report)
    for name in ("set_vs_hicache_file", "get_cold_vs_hicache_file", "exists_vs_hicache_file"):
        assert report["ratios"][name]["n"] == 2, name
