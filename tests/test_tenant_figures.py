"""Figures per tenant (issue 61): a request names its tenant at the core's door, and every
lookup, read, write and admission of it is counted under that tenant, in ``stats()`` and in
Prometheus, with the label values bounded; a salt never reaches a figure."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvcore
from kvcore.errors import ConfigError
from kvcore.metrics import MAX_TENANT_LABELS, PrometheusCollector, TenantCounters
from kvcore.transfer import DeviceCache, TransferManager

LAYOUT = kvcore.CacheLayout(
    num_layers=2, num_heads=2, block_size=4, head_dim=16, dtype="float16", num_blocks=16
)
SALT = "salt-of-team-b-never-shown"


@pytest.fixture
def manager():
    k = [np.zeros(LAYOUT.kv_shape, np.uint16) for _ in range(LAYOUT.num_layers)]
    v = [np.zeros(LAYOUT.kv_shape, np.uint16) for _ in range(LAYOUT.num_layers)]
    tm = TransferManager(
        {"layout": LAYOUT, "max_model_len": 64, "namespace": "tenant-figures"},
        DeviceCache(LAYOUT, k, v),
        "memory",
    )
    yield tm
    tm.close()


def keys_of(first_token: int, blocks: int) -> list[str]:
    return kvcore.block_hashes(list(range(first_token, first_token + 4 * blocks)), 4)


def scrape(target: object) -> dict[tuple[str, frozenset], float]:
    registry = CollectorRegistry()
    registry.register(PrometheusCollector(target))
    text = generate_latest(registry).decode()
    assert SALT not in text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_each_tenants_lookups_reads_and_writes_are_counted_apart(manager):
    a, b = keys_of(0, 3), keys_of(1000, 2)
    manager.write_back({"task_id": "wa", "keys": a, "device_block_ids": [0, 1, 2],
                        "tenant": "team-a"}).result()  # fmt: skip
    manager.write_back({"task_id": "wb", "keys": b[:1], "device_block_ids": [3],
                        "tenant": "team-b"}).result()  # fmt: skip
    assert manager.query({"task_id": "qa", "keys": a, "tenant": "team-a"}) == 3
    assert manager.query({"task_id": "qb", "keys": b, "tenant": "team-b"}) == 1
    got = manager.read({"task_id": "rb", "keys": b, "device_block_ids": [4, 5],
                        "tenant": "team-b"}).result()  # fmt: skip
    assert got.num_blocks == 1
    manager.query({"task_id": "q-none", "keys": a})  # names no tenant: in no tenant's figures
    stats = manager.backend.stats()
    # what each tenant asked the store and what it answered: team-a looked up 3 and found 3;
    # team-b looked up 2 and found 1, then read 2 and got 1 (a write-back's own check of what
    # is stored is not the tenant's lookup)
    assert stats["tenant_blocks.query.team-a"] == 3
    assert stats["tenant_blocks_done.query.team-a"] == 3
    assert stats["tenant_blocks.query.team-b"] == 2
    assert stats["tenant_blocks_done.query.team-b"] == 1
    assert stats["tenant_blocks.read.team-b"] == 2
    assert stats["tenant_blocks_done.read.team-b"] == 1
    assert stats["tenant_blocks_done.write.team-a"] == 3
    assert stats["tenant_blocks_done.write.team-b"] == 1
    assert not any(k.endswith(".default") for k in stats if k.startswith("tenant_"))
    s = scrape(manager)
    label = {("backend", "memory"), ("op", "query")}
    assert s[("kvcore_backend_tenant_blocks_total", frozenset({*label, ("tenant", "team-b")}))] == 2
    assert (
        s[("kvcore_backend_tenant_blocks_done_total", frozenset({*label, ("tenant", "team-b")}))]
        == 1
    )


def test_a_tenant_name_is_checked_at_the_door_naming_the_field(manager):
    with pytest.raises(ConfigError, match=r"\n  tenant: 'team/b' is not a tenant name \("):
        manager.query({"task_id": "q", "keys": keys_of(0, 1), "tenant": "team/b"})
    with pytest.raises(ValueError, match=r"^tenant: '../x' is not a tenant name"):
        manager.backend.request("q", keys_of(0, 1), tenant="../x")
    request = manager.backend.request("q", keys_of(0, 2), tenant="team-a")
    assert request.tenant == "team-a" and request.slice(1, 2).tenant == "team-a"


def test_a_failed_call_counts_every_block_of_the_tenant_as_missed(manager):
    keys = keys_of(0, 2)
    manager.write_back({"task_id": "w", "keys": keys, "device_block_ids": [0, 1]}).result()

    def broken(request):
        raise OSError("disk gone")

    manager.backend._plain.read_hook = broken  # the backend fails every read from now on
    got = manager.read({"task_id": "r", "keys": keys, "device_block_ids": [2, 3],
                        "tenant": "team-a"}).result()  # fmt: skip
    assert got.num_blocks == 0
    stats = manager.backend.stats()
    assert stats["tenant_failures.read.team-a"] >= 1
    assert stats["tenant_blocks_done.read.team-a"] == 0
    assert stats["tenant_blocks.read.team-a"] >= 2


def test_tenant_labels_are_bounded():
    counters = TenantCounters()
    for n in range(MAX_TENANT_LABELS + 40):
        counters.add(f"t{n}", "read", blocks=1)
    tenants = {key.rsplit(".", 1)[1] for key in counters.snapshot()}
    assert len(tenants) == MAX_TENANT_LABELS + 1 and "other" in tenants
    assert counters.snapshot()["tenant_blocks.read.other"] == 40
