"""SGLang's exists answer goes through kvcore's load-or-recompute decision: over a real Mooncake
link shaped with ``tc`` (this test process runs in a loopback-only network namespace), a store
that became slow answers fewer pages than it holds, by the same rule as the core's tests
(``tests/test_load_costs.py``): reading them is expected to take longer than computing them.

The engine's prefill rate is the setting ``prefill_tokens_per_s`` (SGLang's storage layer sees
no engine step): here, a rate at which computing a page takes ten times as long as reading it
over the unshaped link, measured first, so the test holds on any machine.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import _NETNS, page_indices, page_keys
from kv_mooncake.testing import shape_loopback
from kvcore_sglang.testing import create_storage, extra_config, fill_random, mha_host_pool
from kvcore_sglang.testing import storage_config as make_storage_config

PAGES = 8


def _shape(rate: str | None) -> None:
    shape_loopback(rate, burst="8kb", latency="2s")


@pytest.mark.skipif(
    _NETNS is not None or shutil.which("tc") is None,
    reason=f"needs a private network namespace and tc to shape loopback ({_NETNS})",
)
def test_a_store_made_slow_answers_fewer_pages_than_it_holds(mooncake_cluster_factory) -> None:
    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    pool = mha_host_pool("page_first")
    fill_random(pool, 5)
    keys = page_keys(PAGES, seed=5)
    config = cluster.config(close_timeout_s=0.5)
    first = create_storage("dynamic", make_storage_config(extra_config("mooncake", config)), pool)
    storages = [first]
    try:
        assert first.batch_set_v1(keys, page_indices(pool, 0, PAGES)) == [True] * PAGES
        for _ in range(3):
            assert first.batch_get_v1(keys, page_indices(pool, 16, PAGES)) == [True] * PAGES
        fast = first.kvcore_stats()["kv.read_bytes_per_s"]
        _, fmt = first._kv_route()
        # computing a page takes ten times as long as reading it on the unshaped link
        tokens_per_s = fmt.page_size * fast / fmt.page_nbytes / 10
        extra = extra_config("mooncake", config, prefill_tokens_per_s=tokens_per_s)
        storage = create_storage("dynamic", make_storage_config(extra), pool)
        storages.append(storage)
        assert storage.batch_get_v1(keys, page_indices(pool, 16, PAGES)) == [True] * PAGES
        assert storage.batch_exists(keys) == PAGES  # reading is the faster way

        _shape("2mbit")  # a thousand times slower or so than loopback
        assert storage.batch_get_v1(keys, page_indices(pool, 16, PAGES)) == [True] * PAGES
        assert storage.batch_exists(keys) < PAGES  # computing is now the faster way
        stats = storage.kvcore_stats()
        assert stats["decide.loads_declined"] >= 1
        assert stats["pages_declined"] >= 1
        assert stats["kv.read_bytes_per_s"] < fast / 10
    finally:
        _shape(None)
        for made in storages:
            made.close()
