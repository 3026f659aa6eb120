"""``benchmarks/bench_lmcache.py`` reports what every benchmark here promises: each figure and
ratio as its median and range over ``--reps`` repetitions (ratios paired per repetition), goals
naming only ratios reported. Tiny sizes: speeds are the benchmark's business, the report's
shape (and LMCache's round-trip check passing for every contender) is this test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))
from benchutil import check_report  # noqa: E402


def test_bench_lmcache_reports_median_and_spread(tmp_path: Path) -> None:
    command = [
        sys.executable, str(BENCH / "bench_lmcache.py"), "--json", "--reps", "2",
        "--rounds", "2", "--num-keys", "4", "--in-flight", "2", "--data-size-kb", "16",
        "--dir", str(tmp_path),
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    check_report(report)
    assert set(report["goals"]) == {"kvcore_vs_lmcache_fs_store", "kvcore_vs_lmcache_fs_load"}
    for name in report["ratios"]:
        assert report["ratios"][name]["n"] == 2, name
