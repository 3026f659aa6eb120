"""A backend failure is a miss to SGLang, never an exception into its storage threads, and
kvcore's counters reach get_stats."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from conftest import page_bytes, page_indices, page_keys
from kvcore_sglang.testing import (
    create_storage,
    extra_config,
    fill_random,
    mha_host_pool,
    storage_config,
)
from sglang.srt.observability.metrics_collector import StorageMetrics


def filled_pool(seed: int = 1, layout: str = "page_first"):
    pool = mha_host_pool(layout)
    fill_random(pool, seed)
    return pool


def test_a_killed_mooncake_master_gives_misses_not_exceptions(
    mooncake_cluster_factory, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    pool = filled_pool()
    # short deadlines keep the test quick: a dead master must cost at most one deadline per call
    config = cluster.config(rpc_timeout_ms=1000, close_timeout_s=0.5)
    extra = extra_config("mooncake", config, timeout_s=1.0)
    storage = create_storage("dynamic", storage_config(extra, metrics=True), pool)
    try:
        keys = page_keys(4)
        assert storage.batch_set_v1(keys, page_indices(pool, 0, 4)) == [True] * 4
        assert storage.batch_exists(keys) == 4

        cluster.master.kill()
        with caplog.at_level(logging.WARNING):
            assert storage.batch_exists(keys) == 0
            assert storage.batch_get_v1(keys, page_indices(pool, 8, 4)) == [False] * 4
            more = page_keys(2, seed=9)
            assert storage.batch_set_v1(more, page_indices(pool, 4, 2)) == [False, False]
            assert storage.exists(keys[0]) is False
            assert (
                storage.get(keys[0], torch.empty(pool.get_data_page(0).numel(), dtype=pool.dtype))
                is None
            )

        stats = storage.get_stats()
        assert isinstance(stats, StorageMetrics)
        counters = stats.kvcore
        # the misses are counted as failures, not as absent pages
        assert counters["kv.calls.query"] >= 2
        assert counters["kv.backend_miss_rpc_failed"] >= 1
        assert counters["pages_read_ok"] == 0
        assert stats.backup_pgs == [4]  # the one successful write before the kill
    finally:
        storage.close()
        # Mooncake clients of a dead master take ~20 s to close: let the cluster's own
        # storage node find its master again before the fixture closes it
        if cluster.master.process is not None and cluster.master.process.poll() is not None:
            cluster.master.start()


def test_a_master_not_up_at_start_is_a_miss_until_it_opens() -> None:
    """SGLang attaches its storage while the Mooncake master is not up yet: attaching works,
    every call is a miss, and once the master is up the backend opens on the next try (with
    the host pool registered and pages stored and read back)."""
    from kv_mooncake.testing import MooncakeCluster, free_port

    cluster = MooncakeCluster(storage_bytes=64 << 20)
    cluster.master.rpc_port, cluster.master.metrics_port = free_port(), free_port()
    config = cluster.config(connect_timeout_s=1.0)  # where no master listens yet
    extra = extra_config("mooncake", config, reopen_interval_s=0.5)
    pool = filled_pool(6)
    storage = create_storage("dynamic", storage_config(extra), pool)
    try:
        keys = page_keys(3)
        assert storage.batch_exists(keys) == 0
        assert storage.batch_set_v1(keys, page_indices(pool, 0, 3)) == [False] * 3
        assert storage.batch_get_v1(keys, page_indices(pool, 8, 3)) == [False] * 3
        stats = storage.kvcore_stats()
        # kvcore's runner answers every call while the store is not open: a counted miss
        assert stats["kv.host.unavailable.lookup"] == 1
        assert stats["kv.host.unavailable.write"] == 1
        assert stats["kv.host.unavailable.read"] == 1
        assert stats["kv.open_failures"] >= 1

        cluster.start()
        time.sleep(0.6)  # past reopen_interval_s: the next call opens it
        assert storage.batch_set_v1(keys, page_indices(pool, 0, 3)) == [True] * 3
        assert storage.batch_exists(keys) == 3
        assert storage.batch_get_v1(keys, page_indices(pool, 8, 3)) == [True] * 3
        assert page_bytes(pool, 8, 3) == page_bytes(pool, 0, 3)
        assert storage.kvcore_stats()["kv.blocks_done.write"] == 3
    finally:
        storage.close()
        cluster.close()


@pytest.mark.parametrize("backend_spec", ["memory"], indirect=True)
def test_a_full_store_stores_a_leading_run(make_storage) -> None:
    pool = filled_pool(2)
    # 11 objects: the digests kvcore keeps beside the 5 pages (memory keeps no checksums; they
    # are written first), then K and V of 3 pages; the 2 digests without pages are removed
    storage = make_storage(pool, extra={"backend_config": {"max_objects": 11}})
    keys = page_keys(5)
    assert storage.batch_set_v1(keys, page_indices(pool, 0, 5)) == [True] * 3 + [False] * 2
    assert storage.batch_exists(keys) == 3
    assert storage.batch_get_v1(keys, page_indices(pool, 10, 5)) == [True] * 3 + [False] * 2
    assert page_bytes(pool, 10, 3) == page_bytes(pool, 0, 3)
    stats = storage.get_stats().kvcore
    assert stats["pages_written"] == 5 and stats["pages_written_ok"] == 3
    assert stats["kv.blocks_done.write"] == 3


@pytest.mark.parametrize("backend_spec", ["memory"], indirect=True)
def test_bad_calls_are_misses_logged_once(make_storage, caplog: pytest.LogCaptureFixture) -> None:
    pool = filled_pool(3)
    storage = make_storage(pool)
    keys = page_keys(3)
    with caplog.at_level(logging.WARNING, logger="kvcore_sglang"):
        # host indices for 2 pages but 3 keys: SGLang never does this; still no exception
        assert storage.batch_set_v1(keys, page_indices(pool, 0, 2)) == [False] * 3
        assert storage.batch_set_v1(keys, page_indices(pool, 0, 2)) == [False] * 3
        assert storage.batch_get_v1(keys, page_indices(pool, 0, 1)) == [False] * 3
        # a flat page of the wrong size
        assert storage.set(keys[0], torch.zeros(3, dtype=torch.uint8)) is False
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("set failed: ValueError" in m for m in messages) == 1  # once per kind
    assert any("get failed: ValueError" in m for m in messages)
    stats = storage.kvcore_stats()
    assert stats["errors.set"] == 3 and stats["errors.get"] == 1


def test_calls_before_registration_and_after_close_are_misses(tmp_path) -> None:
    extra = extra_config("file", {"root": str(tmp_path)})
    storage = create_storage("dynamic", storage_config(extra))  # no pool registered yet
    keys = page_keys(2)
    assert storage.batch_exists(keys) == 0
    assert storage.batch_get_v1(keys, torch.arange(32)) == [False, False]
    assert storage.clear() is False

    pool = filled_pool(4)
    storage.register_mem_pool_host(pool)
    assert storage.batch_set_v1(keys, page_indices(pool, 0, 2)) == [True, True]
    storage.close()
    assert storage.batch_exists(keys) == 0
    assert storage.batch_set_v1(keys, page_indices(pool, 0, 2)) == [False, False]
    assert storage.kvcore_stats()["errors.exists"] == 2
    storage.close()  # twice is fine


@pytest.mark.parametrize("backend_spec", ["memory"], indirect=True)
def test_storage_metrics_report_pages_and_bandwidth(make_storage) -> None:
    pool = filled_pool(5)
    storage = make_storage(pool, metrics=True)
    keys = page_keys(4)
    storage.batch_set_v1(keys, page_indices(pool, 0, 4))
    storage.batch_get_v1(keys[:3], page_indices(pool, 8, 3))
    first = storage.get_stats()
    assert first.backup_pgs == [4] and first.prefetch_pgs == [3]
    assert len(first.backup_bandwidth) == 1 and first.backup_bandwidth[0] > 0
    second = storage.get_stats()  # SGLang drains them at each report
    assert second.backup_pgs == [] and second.prefetch_pgs == []
    assert second.kvcore["kv.calls.write"] == 1


@pytest.mark.parametrize("backend_spec", ["file"], indirect=True)
def test_pages_the_store_does_not_admit_are_refused_not_failed(make_storage) -> None:
    """kv_file's admission applies to SGLang's backups: under ``second-hit`` a page's first
    offer is refused before anything is staged (reported as handled, so HiCache goes on with
    the operation's next batch; counted as refused, not written), its second is stored. The
    same through the legacy calls (flat pages, raw addresses)."""
    pool = filled_pool(5)
    storage = make_storage(pool, extra={"backend_config": {"admission": "second-hit"}})
    keys = page_keys(4)
    assert storage.batch_set_v1(keys, page_indices(pool, 0, 4)) == [True] * 4
    assert storage.batch_exists(keys) == 0  # refused: nothing written
    stats = storage.get_stats().kvcore
    assert stats["kv.blocks_refused.admit"] == stats["pages_refused"] == 4
    assert stats.get("pages_written", 0) == 0
    assert storage.batch_set_v1(keys, page_indices(pool, 0, 4)) == [True] * 4  # second offer
    assert storage.batch_exists(keys) == 4
    assert storage.batch_get_v1(keys, page_indices(pool, 10, 4)) == [True] * 4
    assert page_bytes(pool, 10, 4) == page_bytes(pool, 0, 4)
    # a new page first in the batch: refused, and the run ends there (a leading run is written)
    fresh = page_keys(3, seed=9)
    assert storage.batch_set_v1([fresh[0], *keys[:2]], page_indices(pool, 4, 3)) == [True] * 3
    assert storage.batch_exists([fresh[0]]) == 0
    stats = storage.get_stats().kvcore
    assert stats["kv.blocks_refused.admit"] == 4 + 3 and stats["pages_written"] == 4

    flat = [pool.get_data_page(i * pool.page_size, flat=True) for i in range(6, 8)]
    legacy = page_keys(2, seed=11)
    assert storage.batch_set(legacy, flat) is True  # first offer: refused, reported handled
    assert storage.batch_exists(legacy) == 0
    assert storage.batch_set(legacy, flat) is True
    assert storage.batch_exists(legacy) == 2
    ptrs, sizes = pool.get_page_buffer_meta(page_indices(pool, 8, 2))
    half = len(ptrs) // 2
    raw = page_keys(2, seed=13)
    locations = [ptrs[:half], ptrs[half:]]
    lengths = [sizes[:half], sizes[half:]]
    assert storage.batch_set(raw, None, locations, lengths) is True
    assert storage.batch_exists(raw) == 0
    assert storage.batch_set(raw, None, locations, lengths) is True
    assert storage.batch_exists(raw) == 2
    stats = storage.get_stats().kvcore
    assert stats["kv.blocks_refused.admit"] == stats["pages_refused"] == 7 + 2 + 2
