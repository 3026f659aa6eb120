"""The operator's tools against a live master: kvcore bench (with the raw-client baseline)
and kvcore check, each in a subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcore", *args], capture_output=True, text=True, timeout=300
    )


def test_bench_reports_kvcore_and_raw_client_figures(mooncake_cluster):
    cfg = json.dumps(mooncake_cluster.config())
    out = _cli(
        "bench",
        "--backend",
        "mooncake",
        "--config",
        cfg,
        "--blocks",
        "2",
        "--repeats",
        "1",
        "--json",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    f, r = data["figures"], data["ratios"]
    assert data["verified"] is True
    assert f["write_gbps"] > 0 and f["read_gbps"] > 0
    assert f["raw_write_gbps"] > 0 and f["raw_read_gbps"] > 0  # the raw client's own calls
    # Ratios come from unrounded figures, so allow the figures' 4-digit rounding.
    assert r["read_vs_raw"] == pytest.approx(f["read_gbps"] / f["raw_read_gbps"], rel=1e-2)


def test_check_passes_against_the_live_master(mooncake_cluster):
    cfg = json.dumps(mooncake_cluster.config())
    out = _cli("check", "mooncake", "--config", cfg, "-k", "round_trip or gap")
    assert out.returncode == 0, out.stdout[-3000:]
    m = re.search(r"kvcore check mooncake: (\d+) passed, (\d+) failed", out.stdout)
    assert m and int(m.group(1)) >= 5 and m.group(2) == "0"


def test_demo_runs_on_mooncake_with_every_byte_verified(mooncake_cluster):
    cfg = json.dumps(mooncake_cluster.config())
    out = _cli(
        "demo",
        "--backend",
        "mooncake",
        "--config",
        cfg,
        "--conversations",
        "2",
        "--turns",
        "2",
        "--json",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    s = json.loads(out.stdout)
    assert s["mismatches"] == 0 and s["errors"] == 0
    assert s["blocks_read"] > 0 and s["blocks_written"] > 0
    assert "mooncake" in s["data_location"]
