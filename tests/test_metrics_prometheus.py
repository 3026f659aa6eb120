"""Prometheus through prometheus-client: a collector in an engine's own registry, the opt-in
HTTP endpoint on 127.0.0.1, and the text every exporter path produces parsed back."""

from __future__ import annotations

import re
import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvcore
from kvcore.metrics import Metrics, PrometheusCollector, serve_prometheus
from kvcore.transfer import DeviceCache, TransferManager

LAYOUT = kvcore.CacheLayout(
    num_layers=2, num_heads=2, block_size=4, head_dim=16, dtype="float16", num_blocks=8
)


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


@pytest.fixture
def manager():
    k = [np.zeros(LAYOUT.kv_shape, np.uint16) for _ in range(LAYOUT.num_layers)]
    v = [np.zeros(LAYOUT.kv_shape, np.uint16) for _ in range(LAYOUT.num_layers)]
    tm = TransferManager(
        {
            "layout": LAYOUT,
            "max_model_len": 64,
            "namespace": "metrics-test",
            "verify_blocks": "never",
        },
        DeviceCache(LAYOUT, k, v),
        "memory",
    )
    keys = kvcore.block_hashes(list(range(12)), LAYOUT.block_size)
    tm.write_back({"task_id": "w", "keys": keys, "device_block_ids": [0, 1, 2]}).result()
    # two reads: a client's first read is not a read-rate sample (it pays for the setup)
    tm.read({"task_id": "r", "keys": keys, "device_block_ids": [3, 4, 5]}).result()
    tm.read({"task_id": "r2", "keys": keys, "device_block_ids": [3, 4, 5]}).result()
    yield tm
    tm.close()


def test_collector_in_an_engines_own_registry(manager):
    registry = CollectorRegistry()
    engine_requests = Counter("engine_requests", "the engine's own metric", registry=registry)
    engine_requests.inc(5)
    registry.register(PrometheusCollector(manager))
    s = _samples(generate_latest(registry).decode())
    assert s[("engine_requests_total", frozenset())] == 5  # the engine's metrics untouched
    write = frozenset({("rank", "0"), ("op", "write")})
    read = frozenset({("rank", "0"), ("op", "read")})
    assert s[("kvcore_transfer_blocks_written_total", write)] == 3
    assert s[("kvcore_transfer_latency_seconds_count", write)] == 1
    assert s[("kvcore_transfer_latency_seconds_count", read)] == 2
    assert s[("kvcore_transfer_staging_bytes", frozenset({("rank", "0")}))] >= 0
    backend_write = frozenset({("backend", "memory"), ("op", "write")})
    assert s[("kvcore_backend_calls_total", backend_write)] >= 1
    assert s[("kvcore_backend_backend_objects", frozenset({("backend", "memory")}))] == 6
    # the read rate the facade measured (the load-or-recompute decision's store side)
    assert s[("kvcore_backend_read_bytes_per_s", frozenset({("backend", "memory")}))] > 0


def test_each_scrape_reads_current_values(manager):
    registry = CollectorRegistry()
    registry.register(PrometheusCollector(manager.backend))  # a Backend alone works too
    key = ("kvcore_backend_calls_total", frozenset({("backend", "memory"), ("op", "query")}))
    before = _samples(generate_latest(registry).decode()).get(key, 0)
    manager.query({"task_id": "q", "keys": kvcore.block_hashes(list(range(8)), 4)})
    assert _samples(generate_latest(registry).decode())[key] == before + 1


def test_http_endpoint_is_opt_in_and_on_loopback(manager):
    server, thread = serve_prometheus(manager, port=0)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            body = reply.read().decode()
        assert reply.status == 200
        assert "kvcore_transfer_blocks_written_total" in body
        assert "kvcore_backend_calls_total" in body
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_metrics_prometheus_text_parses_back():
    m = Metrics("kvcore_test", {"rank": "1"})
    m.observe("read", 0.003, calls=1, hits=4)
    m.add("write", errors=2)
    s = _samples(m.prometheus(extra={"staging_bytes": 1024, "odd-name.x": 1}))
    assert s[("kvcore_test_hits_total", frozenset({("rank", "1"), ("op", "read")}))] == 4
    assert s[("kvcore_test_errors_total", frozenset({("rank", "1"), ("op", "write")}))] == 2
    bucket = frozenset({("rank", "1"), ("op", "read"), ("le", "0.005")})
    assert s[("kvcore_test_latency_seconds_bucket", bucket)] == 1
    assert s[("kvcore_test_staging_bytes", frozenset({("rank", "1")}))] == 1024
    assert s[("kvcore_test_odd_name_x", frozenset({("rank", "1")}))] == 1  # sanitised name


def test_a_collector_refuses_what_has_no_metrics():
    with pytest.raises(TypeError, match="no kvcore metrics"):
        list(PrometheusCollector(object()).collect())


def test_demo_serves_its_metrics_on_loopback_only_when_asked(tmp_path):
    from test_cli import kvcore_cli

    small = ("demo", "--backend", "memory", "--turns", "1", "--conversations", "1")
    env = {"KVCORE_LOG_DIR": str(tmp_path)}
    served = kvcore_cli(*small, "--metrics-port", "0", env=env)
    assert served.returncode == 0, served.stderr
    assert re.search(r"^metrics: http://127\.0\.0\.1:\d+/metrics$", served.stderr, re.M)
    plain = kvcore_cli(*small, env=env)
    assert plain.returncode == 0 and "metrics:" not in plain.stderr
