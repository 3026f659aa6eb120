"""``kvcore stats``: kvcore's figures from an engine's Prometheus endpoint or from a store,
per operation, per tenant and as gauges."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvcore
from kvcore.cli import main
from kvcore.metrics import serve_prometheus
from kvcore.transfer import DeviceCache, TransferManager

LAYOUT = kvcore.CacheLayout(
    num_layers=2, num_heads=2, block_size=4, head_dim=16, dtype="float16", num_blocks=16
)


@pytest.fixture
def manager(tmp_path: Path):
    k = [np.zeros(LAYOUT.kv_shape, np.uint16) for _ in range(LAYOUT.num_layers)]
    v = [np.zeros(LAYOUT.kv_shape, np.uint16) for _ in range(LAYOUT.num_layers)]
    tm = TransferManager(
        {"layout": LAYOUT, "max_model_len": 64, "namespace": "stats-cli"},
        DeviceCache(LAYOUT, k, v),
        "file",
        backend_config={"root": str(tmp_path / "store")},
    )
    a = kvcore.block_hashes(list(range(12)), 4)
    b = kvcore.block_hashes(list(range(100, 108)), 4)
    tm.write_back({"task_id": "wa", "keys": a, "device_block_ids": [0, 1, 2],
                   "tenant": "team-a"}).result()  # fmt: skip
    tm.query({"task_id": "qa", "keys": a, "tenant": "team-a"})
    tm.query({"task_id": "qb", "keys": b, "tenant": "team-b"})
    yield tm
    tm.close()


def test_stats_of_an_engines_endpoint_per_operation_and_per_tenant(manager, capsys):
    server, _ = serve_prometheus(manager, 0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert main(["stats", url, "--json"]) == 0
        figures = json.loads(capsys.readouterr().out)
        assert main(["stats", url]) == 0
        text = capsys.readouterr().out
    finally:
        server.shutdown()
    tenants = figures["tenants"]
    assert tenants["team-a"]["query"] == {"blocks": 3, "blocks_done": 3}
    assert tenants["team-b"]["query"] == {"blocks": 2, "blocks_done": 0}
    assert tenants["team-a"]["write"]["blocks_done"] == 3
    assert figures["ops"]["backend query (backend=file)"]["calls"] >= 2
    assert figures["ops"]["transfer write (rank=0)"]["tasks"] == 1
    assert figures["gauges"]["backend_backend_objects{backend=file}"] == 6
    assert "per tenant:" in text and "team-a" in text and "100.0" in text


def test_stats_of_a_store_opened_by_name(manager, capsys, tmp_path: Path):
    config = json.dumps({"root": str(tmp_path / "store")})
    assert main(["stats", "file", "--config", config, "--namespace", "stats-cli", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["gauges"]["backend_objects"] == 6  # 3 blocks, K and V


def test_stats_names_an_endpoint_it_cannot_scrape(capsys):
    assert main(["stats", "http://127.0.0.1:9/metrics"]) != 0
    err = capsys.readouterr().err
    assert "cannot scrape 'http://127.0.0.1:9/metrics'" in err
