"""``benchmarks/bench_transfer.py`` runs end to end on a tiny layout and reports what issue 12
asks of it: the host-resident ratios, the staged overlap ratios against the slower stage, and
the two figures that bracket the pipeline (serial combination, stages side by side), with the
bytes read back verified. Every figure and ratio comes as its median and range over the
repetitions. Speeds are not checked here: they are the benchmark's business."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_transfer_reports_its_ratios_on_a_tiny_layout(tmp_path: Path) -> None:
    options = {
        "--layers": 2, "--heads": 1, "--block-size": 16, "--head-dim": 64, "--blocks": 6,
        "--pipeline-blocks": 2, "--reps": 2, "--query-blocks": 50,
        "--root": tmp_path, "--ram-root": tmp_path,
    }  # fmt: skip
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_transfer.py"), "--json"]
    for option, value in options.items():
        command += [option, str(value)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bytes_verified"] is True
    assert report["host_resident"] == "measured"
    ratios, figures = report["ratios"], report["figures"]
    for section in (ratios, figures):
        for name, value in section.items():
            assert set(value) >= {"median", "min", "max", "n"}, name
            assert value["n"] >= 2, name
            assert 0 < value["min"] <= value["median"] <= value["max"], name
    for name in (
        "host_resident_read_warm_vs_backend",
        "host_resident_write_back_vs_backend",
        "host_resident_write_back_vs_backend_segmented",
        "staged_write_back_vs_slower_stage",
        "staged_read_cold_vs_slower_stage",
        "staged_write_back_vs_side_by_side",
        "staged_read_cold_vs_side_by_side",
        "staged_write_back_vs_serial_combination",
        "query_10k_blocks_with_request_vs_5ms",
    ):
        assert ratios[name]["median"] > 0, name
        if not name.startswith("query"):  # the query runs max(3, --reps) times on its own
            assert ratios[name]["n"] == 2, name  # one per repetition: paired, not of medians
    for name in (
        "staged_write_serial_combination_gbps",
        "staged_write_side_by_side_gbps",
        "staged_read_cold_side_by_side_gbps",
    ):
        assert figures[name]["n"] == 2, name
    assert set(report["goals"]) <= set(ratios)
    assert (
        report["bytes_per_op"] == 6 * 2 * 2 * 16 * 64 * 2
    )  # blocks, K+V, layers, tokens, dim, bf16
