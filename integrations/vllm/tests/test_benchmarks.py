"""The vLLM benchmarks run in this venv and report what issue 28 asks of every benchmark: each
figure and ratio as its median and range over ``--reps`` repetitions, goals and limits naming
only ratios reported. Tiny sizes: speeds are the benchmarks' business, the shape is this
test's. (``bench_vllm.py``'s decode-step A/A control is checked on a tiny engine run too.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))
from benchutil import check_report  # noqa: E402


def run_bench(name: str, args: list[str], cwd: Path, timeout: float) -> dict:
    command = [sys.executable, str(BENCH / f"{name}.py"), "--json", *args]
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bench_vllm_tier_reports_median_and_spread(tmp_path: Path) -> None:
    args = ["--chunks", "4", "--chunk-mib", "0.25", "--job-chunks", "2", "--lookup-chunks", "100"]
    report = run_bench("bench_vllm_tier", [*args, "--reps", "2", "--dir", str(tmp_path)],
                       tmp_path, timeout=300)  # fmt: skip
    check_report(report)
    assert report["goals"]
    # both tiers' loads against the device's limit, measured on the same files in the run
    assert {"fs_load_cold_vs_limit", "kvcore_load_cold_vs_limit"} <= set(report["limits"])
    assert report["figures"]["limit_load_cold_gbps"]["n"] == 2
    # and the kvcore tier's against the limit on its own objects, measured next to its load
    assert "kvcore_load_cold_vs_own_limit" in report["limits"]
    assert report["goals"]["kvcore_load_cold_vs_own_limit"] == ">= 0.98"
    assert report["figures"]["kvcore_files_limit_load_cold_gbps"]["n"] == 2


def test_bench_vllm_decode_ab_carries_its_aa_control(tmp_path: Path) -> None:
    """Four real engines taking turns: the A/A control (two engines without the connector) is
    reported beside the connector's A/B, each as a median and range of paired rounds."""
    args = ["--only", "decode", "--model", "tiny", "--reps", "2", "--decode-prompts", "1"]
    args += ["--workdir", str(tmp_path)]
    report = run_bench("bench_vllm", args, tmp_path, timeout=900)
    check_report(report)
    ratios = report["ratios"]
    for name in (
        "decode_step_aa_control",
        "decode_step_with_vs_without_connector",
        "decode_step_events_vs_no_events",
    ):
        assert ratios[name]["n"] == 2, name
    assert report["connector_hook_ms_per_step_with"] > 0
    # every engine bound to the same cores: vLLM's own choice differs with a connector
    assert report["VLLM_CPU_OMP_THREADS_BIND"]


def test_bench_vllm_itl_reports_restores_beside_their_aa_control(tmp_path: Path) -> None:
    """A decode stream's ITL on four real engines, two rounds: the A/A control and the sync and
    async restores' ratios over the stream alone, and restores that came from the store."""
    prompt_tokens = 600  # under the tiny model's 2,048 positions, 18 blocks to restore
    args = ["--only", "itl", "--model", "tiny", "--reps", "2"]
    args += ["--prompt-tokens", str(prompt_tokens), "--workdir", str(tmp_path)]
    report = run_bench("bench_vllm", args, tmp_path, timeout=600)
    check_report(report)
    ratios = report["ratios"]
    for stat in ("p99", "median"):
        for name in ("aa_control", "async_vs_no_restore", "sync_vs_no_restore"):
            assert ratios[f"itl_{stat}_{name}"]["n"] == 2, (stat, name)
    assert report["goals"]["itl_p99_async_vs_no_restore"].startswith("<= ")
    for mode in ("sync", "async"):
        # the whole prompt but its last, partial block came from the store
        cached = report[f"itl_restore_cached_tokens_{mode}"]
        assert len(cached) == 2 and all(n >= prompt_tokens - 32 for n in cached), (mode, cached)
        assert report["figures"][f"itl_restore_ttft_{mode}_s"]["n"] == 2
    assert report["itl_window_tokens"] == [140]
