"""Every benchmark in ``benchmarks/`` that runs in this environment reports what issue 28 asks:
each figure and ratio as its median and range over ``--reps`` repetitions (ratios per
repetition, paired), goals and limits naming only ratios it reports, and a list of flags; and
``benchmarks/run.py`` combines several runs into the median of run medians and a run-to-run
spread. Sizes are tiny: speeds are the benchmarks' business, the report's shape is this test's.
(``bench_transfer`` has its own test; ``bench_vllm_tier``, ``bench_sglang`` and ``bench_vllm``
are checked in their engines' suites.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
from benchutil import check_report  # noqa: E402

TINY_LAYOUT = ["--layers", "2", "--heads", "1", "--block-size", "16", "--head-dim", "64"]

CASES = {
    "bench_ops": [*TINY_LAYOUT, "--blocks", "4", "--cache-blocks", "8", "--reps", "2"],
    "bench_dispatch": ["--calls", "200", "--reps", "2"],
    "bench_file": [
        *TINY_LAYOUT, "--blocks", "4", "--reps", "2", "--query-keys", "200",
        "--shared-blocks", "8", "--shared-typical-blocks", "2",
    ],
    "bench_events": [
        "--blocks", "2", "--small-blocks", "16", "--reps", "2", "--layouts", "typical,small",
    ],
    "bench_mooncake_listing": ["--keys", "2000", "--reps", "2", "--watch-interval", "0.2"],
}  # fmt: skip


def run_bench(name: str, args: list[str], tmp_path: Path, timeout: float = 300) -> dict:
    command = [sys.executable, str(BENCH / f"{name}.py"), "--json", *args]
    out = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_reports_median_and_spread(name: str, tmp_path: Path) -> None:
    args = list(CASES[name])
    if name in ("bench_file", "bench_events"):
        args += ["--dir", str(tmp_path)]
    report = run_bench(name, args, tmp_path)
    check_report(report)
    assert report["goals"], f"{name}: no goals"


def test_bench_file_measures_its_native_ceiling(tmp_path: Path) -> None:
    """``--only ceiling``: kv_file's native batches against the same without the checksum,
    reads and writes, rates and CPU per GB: every repetition checked to have read and written
    every object."""
    args = [
        *TINY_LAYOUT,
        "--blocks",
        "4",
        "--reps",
        "2",
        "--only",
        "ceiling",
        "--dir",
        str(tmp_path),
    ]
    report = run_bench("bench_file", args, tmp_path)
    check_report(report)
    for op in ("read", "write"):
        assert report["ratios"][f"ceiling_{op}_vs_no_checksum"]["n"] == 9  # at least 9 reps
        assert report["ratios"][f"ceiling_{op}_cpu_vs_no_checksum"]["median"] > 0
        for who in ("kv", "no_checksum"):
            assert report["figures"][f"ceiling_{op}_{who}_gbps"]["median"] > 0


def test_bench_mooncake_reports_median_and_spread(tmp_path: Path) -> None:
    # the README's test command installs kv_mooncake and Mooncake's wheel: no skip there
    pytest.importorskip("kv_mooncake.testing", reason="kv_mooncake is not installed")
    args = [*TINY_LAYOUT, "--blocks", "2", "--reps", "2", "--query-iters", "10"]
    report = run_bench("bench_mooncake", [*args, "--segment-mib", "64"], tmp_path)
    check_report(report)
    assert set(report["limits"]) == {"write_vs_raw", "read_vs_raw", "query_vs_raw"}


def test_bench_replay_reports_median_and_spread(tmp_path: Path) -> None:
    # a conversation-like trace of its own: shared roots, growing prefixes, one-off tails
    rng = np.random.default_rng(5)
    with (tmp_path / "trace.jsonl").open("w") as f:
        for n in range(300):
            root = int(rng.integers(0, 4))
            ids = [
                root,
                10 + root * 8 + int(rng.integers(0, 8)),
                *(1000 + 3 * n + i for i in range(3)),
            ]
            f.write(json.dumps({"timestamp": n, "input_length": 2560, "output_length": 8,
                                "hash_ids": ids}) + "\n")  # fmt: skip
    args = ["--trace", str(tmp_path / "trace.jsonl"), "--capacities", "4096,8192", "--reps", "2",
            "--dir", str(tmp_path)]  # fmt: skip
    report = run_bench("bench_replay", args, tmp_path)
    check_report(report)
    for capacity in ("4096t", "8192t"):
        assert report["ratios"][f"{capacity}_adaptive_io_vs_simulate_gap"]["max"] == 0
        assert report["ratios"][f"{capacity}_all_vs_independent_lru_gap"]["max"] == 0


def test_bench_tenants_reports_the_issues_ratios(tmp_path: Path) -> None:
    # a quiet tenant rereading a hot prefix after one-off tails, beside the bench's flood
    with (tmp_path / "trace.jsonl").open("w") as f:
        for n in range(200):
            ids = [1, 2, 3, 4, 1000 + n]
            f.write(json.dumps({"timestamp": n, "input_length": 2560, "output_length": 8,
                                "hash_ids": ids}) + "\n")  # fmt: skip
    args = ["--trace", str(tmp_path / "trace.jsonl"), "--capacities", "8192",
            "--floods", "10,200", "--policies", "all", "--reps", "2"]  # fmt: skip
    report = run_bench("bench_tenants", args, tmp_path)
    check_report(report)
    ratios = report["ratios"]
    assert set(report["goals"]) == {
        "8192t_quiet_tenant_vs_alone",
        "8192t_work_conserving_vs_no_tenants",
        "8192t_flood200x_quiet_tenant_vs_alone",
    }
    # 16 blocks: the 200x flood writes 16 between two quiet requests, the 10x one fewer
    assert ratios["8192t_flood200x_quiet_tenant_vs_alone"]["median"] == 1.0
    assert ratios["8192t_flood200x_quiet_tenant_no_shares_vs_alone"]["median"] == 0.0
    assert ratios["8192t_work_conserving_vs_no_tenants"]["median"] == 1.0


def test_bench_tiered_reports_median_and_spread(tmp_path: Path) -> None:
    pytest.importorskip("kv_tiered")
    args = ["--blocks", "2", "--reps", "2", "--file-lower", "--dir", str(tmp_path)]
    report = run_bench("bench_tiered", args, tmp_path)
    check_report(report)
    assert set(report["goals"]) == {
        "stack_promoted_read_vs_upper_alone",
        "stack_write_through_vs_upper_alone",
    }
    assert report["setup"]["promoted_blocks"] == 2 * 2  # every repetition's read was promoted


def test_check_report_names_what_is_wrong() -> None:
    good = {
        "figures": {"a_gbps": {"median": 2, "min": 1, "max": 3, "n": 3, "unit": "GB/s"}},
        "ratios": {"a_vs_b": {"median": 1, "min": 0.9, "max": 1.1, "n": 3}},
        "goals": {"a_vs_b": ">= 1"},
        "limits": ["a_vs_b"],
        "flags": [],
    }
    check_report(good)
    bare = {**good, "ratios": {"a_vs_b": 1.0}}
    with pytest.raises(AssertionError, match=r"ratios\.a_vs_b: a bare number"):
        check_report(bare)
    single = {**good, "figures": {"a_gbps": {**good["figures"]["a_gbps"], "n": 1}}}
    with pytest.raises(AssertionError, match=r"figures\.a_gbps: n=1"):
        check_report(single)
    stray = {**good, "goals": {"c_vs_d": ">= 1"}}
    with pytest.raises(AssertionError, match="goals"):
        check_report(stray)


def test_run_py_reports_median_of_runs_and_spread(tmp_path: Path) -> None:
    command = [
        sys.executable, str(BENCH / "run.py"), "bench_ops", "bench_dispatch", "--runs", "2",
        "--json", "--args", "bench_ops=" + " ".join(CASES["bench_ops"]),
        "--args", "bench_dispatch=" + " ".join(CASES["bench_dispatch"]),
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    # alternated order: run 1 ops then dispatch, run 2 dispatch then ops
    progress = [line.split()[1] for line in out.stderr.splitlines() if line.startswith("run.py:")]
    assert progress == ["bench_ops", "bench_dispatch", "bench_dispatch", "bench_ops"]
    for name in ("bench_ops", "bench_dispatch"):
        combined = result[name]
        assert len(combined["runs"]) == 2
        for run in combined["runs"]:
            check_report(run)
        for section in ("figures", "ratios"):
            assert set(combined[section]) == set(combined["runs"][0][section])
            for key, entry in combined[section].items():
                medians = [r[section][key]["median"] for r in combined["runs"]]
                assert entry["run_medians"] == pytest.approx(medians, rel=1e-3), key
                lo, hi = min(medians), max(medians)
                if lo > 0:
                    assert entry["spread"] == pytest.approx(hi / lo, rel=1e-2), key
                assert lo <= entry["median_of_runs"] <= hi, key
        assert isinstance(combined["flags"], list)
    # the saved result renders as RESULTS.md's tables, a spread column in each
    saved = tmp_path / "runs.json"
    saved.write_text(out.stdout)
    md = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--from", str(saved), "--markdown"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "| spread (max/min) |" in md
    for name in ("bench_ops", "bench_dispatch"):
        assert f"### `{name}` — 2 runs" in md
    assert "swap_layout_gather_vs_contiguous_copy (limit)" in md
