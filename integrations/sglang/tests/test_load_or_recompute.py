"""SGLang's exists answer goes through kvcore's load-or-recompute decision: over a real Mooncake
link shaped with ``tc`` (this test process runs in a loopback-only network namespace), a store
that became slow answers fewer pages than it holds, by the same rule as the core's tests
(``tests/test_load_costs.py``): reading them is expected to take longer than computing them.

The engine's prefill rate is the setting ``prefill_tokens_per_s`` (SGLang's storage layer sees
no engine step). It is set from the shaped link's ceiling, which ``tc`` enforces whatever else
the machine runs: computing a page takes as long as reading it at sixteen times that ceiling.
An earlier form set it from a read measured on the unshaped link; beside other work that
measurement varied more than tenfold between two storages, and the test failed both ways.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import _NETNS, page_indices, page_keys
from kv_mooncake.testing import shape_loopback
from kvcore_sglang.testing import create_storage, extra_config, fill_random, mha_host_pool
from kvcore_sglang.testing import storage_config as make_storage_config

PAGES = 8
# 64 KiB pages: a read of eight (512 KiB) is mostly bandwidth, not a call's latency
LAYERS, HEADS, HEAD_DIM = 2, 4, 128
#: the shaped link's ceiling: 2 Mbit/s, in bytes per second
SHAPED_BYTES_PER_S = 2_000_000 / 8
#: the read rate at which loading a page and computing it take as long: sixteen times the
#: shaped ceiling, and some hundred times below a loopback read on a loaded 2-core machine
BREAK_EVEN_BYTES_PER_S = 16 * SHAPED_BYTES_PER_S


def _shape(rate: str | None) -> None:
    # the bucket must hold one packet of loopback's 64 KiB MTU: tbf drops a larger one, and a
    # read that needs it stalls until its deadline
    shape_loopback(rate, burst="96kb", latency="2s")


@pytest.mark.skipif(
    _NETNS is not None or shutil.which("tc") is None,
    reason=f"needs a private network namespace and tc to shape loopback ({_NETNS})",
)
def test_a_store_made_slow_answers_fewer_pages_than_it_holds(mooncake_cluster_factory) -> None:
    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    pool = mha_host_pool("page_first", layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM)
    fill_random(pool, 5)
    keys = page_keys(PAGES, seed=5)
    config = cluster.config(close_timeout_s=0.5)
    page_nbytes = 2 * LAYERS * pool.page_size * HEADS * HEAD_DIM * 2  # K and V, bfloat16
    tokens_per_s = pool.page_size * BREAK_EVEN_BYTES_PER_S / page_nbytes
    extra = extra_config("mooncake", config, prefill_tokens_per_s=tokens_per_s)
    storage = create_storage("dynamic", make_storage_config(extra), pool)
    try:
        assert storage.batch_set_v1(keys, page_indices(pool, 0, PAGES)) == [True] * PAGES
        for _ in range(3):  # the first read of a client's life is not measured
            assert storage.batch_get_v1(keys, page_indices(pool, 16, PAGES)) == [True] * PAGES
        fast = storage.kvcore_stats()["kv.read_bytes_per_s"]
        assert fast > BREAK_EVEN_BYTES_PER_S, f"loopback read only {fast:.0f} B/s"
        assert storage.batch_exists(keys) == PAGES  # reading is the faster way

        _shape("2mbit")
        assert storage.batch_get_v1(keys, page_indices(pool, 16, PAGES)) == [True] * PAGES
        assert storage.batch_exists(keys) < PAGES  # computing is now the faster way
        stats = storage.kvcore_stats()
        assert stats["decide.loads_declined"] >= 1
        assert stats["pages_declined"] >= 1
        assert stats["kv.read_bytes_per_s"] < BREAK_EVEN_BYTES_PER_S
    finally:
        _shape(None)
        storage.close()
