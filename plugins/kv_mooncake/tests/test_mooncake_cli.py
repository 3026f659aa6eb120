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


def _cli_json(command: str, cluster, *options: str) -> dict:
    """``kvcore <command> --backend mooncake --config <cluster's> <options> --json``'s answer."""
    cfg = json.dumps(cluster.config())
    out = _cli(command, "--backend", "mooncake", "--config", cfg, *options, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_bench_reports_kvcore_and_raw_client_figures(mooncake_cluster):
    data = _cli_json("bench", mooncake_cluster, "--blocks", "2", "--repeats", "1")
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
    s = _cli_json("demo", mooncake_cluster, "--conversations", "2", "--turns", "2")
    assert s["mismatches"] == 0 and s["errors"] == 0
    assert s["blocks_read"] > 0 and s["blocks_written"] > 0
    assert "mooncake" in s["data_location"]
