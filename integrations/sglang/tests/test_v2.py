"""The v2 API for hybrid pools, on SGLang's real MambaPoolHost beside the KV host pool."""

from __future__ import annotations

import ctypes

import pytest
import torch
from conftest import ALL_BACKENDS, SHARED_BACKENDS, page_bytes, page_indices, page_keys
from kvcore_sglang.testing import fill_random, mamba_host_pool, mha_host_pool, mla_host_pool
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

KV, MAMBA = PoolName.KV, PoolName.MAMBA


def slot_bytes(pool, slot: int) -> bytes:
    ptrs, sizes = pool.get_page_buffer_meta(torch.tensor([slot]))
    return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes, strict=True))


def hybrid(make_storage, seed: int = 1, *, mla: bool = False, **identity):
    kv = mla_host_pool() if mla else mha_host_pool()
    mamba = mamba_host_pool(slots=16)
    fill_random(kv, seed)
    fill_random(mamba, seed + 100)
    storage = make_storage(kv, is_mla=mla, **identity)
    storage.register_mem_host_pool_v2(kv, KV)
    storage.register_mem_host_pool_v2(mamba, MAMBA)
    storage.on_host_pools_registered()
    return storage, kv, mamba


def states(keys: list[str], slots: list[int], policy=PoolHitPolicy.TRAILING_PAGES) -> PoolTransfer:
    return PoolTransfer(name=MAMBA, host_indices=torch.tensor(slots), keys=keys, hit_policy=policy)


@pytest.mark.parametrize("backend_spec", ALL_BACKENDS, indirect=True)
def test_kv_and_mamba_state_round_trip(make_storage) -> None:
    storage, kv, mamba = hybrid(make_storage)
    keys = page_keys(4)
    done = storage.batch_set_v2(
        [
            PoolTransfer(name=KV, host_indices=page_indices(kv, 0, 4), keys=keys),
            states([keys[3]], [2]),
        ]
    )
    assert done == {KV: [True] * 4, MAMBA: [True]}

    got = storage.batch_get_v2(
        [
            PoolTransfer(name=KV, host_indices=page_indices(kv, 10, 4), keys=keys),
            states([keys[3]], [9]),
        ]
    )
    assert got == {KV: [True] * 4, MAMBA: [True]}
    assert page_bytes(kv, 10, 4) == page_bytes(kv, 0, 4)
    assert slot_bytes(mamba, 9) == slot_bytes(mamba, 2)
    # the v2 KV objects are the v1 ones
    assert storage.batch_get_v1(keys, page_indices(kv, 20, 4)) == [True] * 4
    assert storage.batch_get_v2([states([keys[0]], [5])]) == {MAMBA: [False]}


@pytest.mark.parametrize("backend_spec", ["memory"], indirect=True)
def test_exists_v2_follows_each_pools_hit_policy(make_storage) -> None:
    storage, kv, _ = hybrid(make_storage, seed=2)
    keys = page_keys(6)
    storage.batch_set_v1(keys[:5], page_indices(kv, 0, 5))  # KV for pages 0..4
    storage.batch_set_v2([states([keys[1]], [1]), states([keys[4]], [4])])

    # trailing window of one page: prefixes ending at a page with its state are restorable
    result = storage.batch_exists_v2(keys, [states([keys[-1]], [0])])
    assert result.kv_hit_pages == 5
    assert result.restorable_prefix_pages == [2, 5]
    assert result.extra_pool_hit_pages == {KV: 5, MAMBA: 5}

    # a window of two pages: only prefix 2 ([1, 2) lacks a state, [3, 5) too) -> none
    result = storage.batch_exists_v2(keys, [states(keys[:2], [0, 1])])
    assert result.kv_hit_pages == 0 and result.restorable_prefix_pages == []

    # all_pages: the pool must hold every page of the prefix
    result = storage.batch_exists_v2(keys, [states(keys, [0], PoolHitPolicy.ALL_PAGES)])
    assert result.kv_hit_pages == 0  # page 0 has no state

    # block_groups is not served: that pool reports nothing and does not shorten the KV hit
    result = storage.batch_exists_v2(keys, [states(keys, [0], PoolHitPolicy.BLOCK_GROUPS)])
    assert result.kv_hit_pages == 5 and MAMBA not in result.extra_pool_hit_pages


@pytest.mark.parametrize("backend_spec", SHARED_BACKENDS, indirect=True)
def test_mamba_state_is_per_tp_rank_while_mla_kv_is_shared(make_storage) -> None:
    keys = page_keys(2)
    rank0, kv0, _ = hybrid(make_storage, seed=3, mla=True, tp_rank=0, tp_size=2)
    rank1, _, _ = hybrid(make_storage, seed=4, mla=True, tp_rank=1, tp_size=2)
    assert rank0.batch_set_v1(keys, page_indices(kv0, 0, 2)) == [True, True]
    assert rank0.batch_set_v2([states([keys[1]], [0])]) == {MAMBA: [True]}

    assert rank1.batch_exists(keys) == 2  # the latent KV is the same on every rank
    result = rank1.batch_exists_v2(keys, [states([keys[1]], [0])])
    assert result.kv_hit_pages == 0  # rank 1's Mamba shard is not stored yet
    assert rank1.batch_set_v2([states([keys[1]], [3])]) == {MAMBA: [True]}
    assert rank1.batch_exists_v2(keys, [states([keys[1]], [0])]).kv_hit_pages == 2


@pytest.mark.parametrize("backend_spec", ["memory"], indirect=True)
def test_unregistered_pools_and_bad_transfers_are_misses(make_storage) -> None:
    storage, _, _ = hybrid(make_storage, seed=5)
    keys = page_keys(2)
    stray = PoolTransfer(name=PoolName.SWA, host_indices=torch.tensor([0, 1]), keys=keys)
    assert storage.batch_set_v2([stray]) == {PoolName.SWA: [False, False]}
    no_indices = PoolTransfer(name=MAMBA, host_indices=None, keys=keys[:1])
    assert storage.batch_get_v2([no_indices]) == {MAMBA: [False]}
    assert storage.kvcore_stats()["errors.set_v2"] == 1
