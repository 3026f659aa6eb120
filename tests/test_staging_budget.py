"""Staging memory a user can predict: a budget, spans that shrink to fit it, an error before
any allocation when it cannot hold one task, and the figure in stats() and the log."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import kvcore
from kvcore.transfer import DeviceCache, TransferManager

#: the typical layout: 28 layers x 8 heads x 64 tokens x 128 dim, bfloat16 (7 MiB per block)
TYPICAL = kvcore.CacheLayout(
    num_layers=28, num_heads=8, block_size=64, head_dim=128, dtype="bfloat16", num_blocks=4
)


def tiny_cache(layout: kvcore.CacheLayout) -> DeviceCache:
    kv = [np.zeros((layout.num_blocks, *layout.kv_block_shape), np.uint16)] * layout.total_layers
    return DeviceCache(layout, kv, kv)


def staged(**cfg) -> TransferManager:
    conf = {"layout": TYPICAL, "max_model_len": 32768, "storage_io": "staged", **cfg}
    return TransferManager(conf, tiny_cache(TYPICAL), "memory")


def test_the_default_budget_keeps_a_long_context_manager_within_one_gib(caplog):
    with caplog.at_level(logging.INFO, logger="kvcore.transfer"):
        tm = staged()
    used = tm.memory_bytes()["staging_bytes"]
    assert 0 < used <= 2**30
    assert tm.stats()["staging_bytes"] == used
    assert "staging_bytes" in caplog.text and "MiB" in caplog.text
    # (2 + 1) + (2 + 1) buffers x depth 2 x span x 7 MiB <= 1 GiB: spans of 12 blocks, not 512
    assert tm.config.span_blocks == 2**30 // (6 * 2 * TYPICAL.block_bytes)
    tm.close()


def test_a_larger_budget_allows_the_configured_span():
    tm = staged(staging_budget_bytes="4GiB", pipeline_blocks=16)
    assert tm.config.span_blocks == 16
    assert tm.memory_bytes()["staging_bytes"] == 6 * 2 * 16 * TYPICAL.block_bytes
    tm.close()


def test_a_budget_too_small_for_one_task_is_refused_before_allocating():
    with pytest.raises(kvcore.ConfigError, match=r"staging_budget_bytes.*cannot hold one task"):
        staged(staging_budget_bytes="64MiB")


def test_no_staging_at_all_on_the_host_resident_path():
    conf = {"layout": TYPICAL, "max_model_len": 32768, "staging_budget_bytes": "1MB"}
    tm = TransferManager(conf, tiny_cache(TYPICAL), "memory")
    assert tm.storage_io == "host_resident"
    assert tm.memory_bytes()["staging_bytes"] == 0
    tm.close()
