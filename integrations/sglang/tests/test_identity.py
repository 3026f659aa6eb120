"""TP/PP identity from HiCacheStorageConfig names the objects: ranks never read each other's
slices, MLA pages are shared by all TP ranks and written by the storage-writer rank alone."""

from __future__ import annotations

import pytest
from conftest import SHARED_BACKENDS, page_bytes, page_indices, page_keys
from kvcore_sglang.testing import fill_random, mha_host_pool, mla_host_pool


def filled(pool_factory, seed: int):
    pool = pool_factory()
    fill_random(pool, seed)
    return pool


@pytest.mark.parametrize("backend_spec", SHARED_BACKENDS, indirect=True)
def test_mha_tp_ranks_store_their_own_slices(make_storage) -> None:
    keys = page_keys(3)
    rank0_pool, rank1_pool = filled(mha_host_pool, 1), filled(mha_host_pool, 2)
    rank0 = make_storage(rank0_pool, tp_rank=0, tp_size=2)
    rank1 = make_storage(rank1_pool, tp_rank=1, tp_size=2)

    assert rank0.batch_set_v1(keys, page_indices(rank0_pool, 0, 3)) == [True] * 3
    assert rank1.batch_exists(keys) == 0  # rank 1's heads are not rank 0's
    assert rank1.batch_set_v1(keys, page_indices(rank1_pool, 0, 3)) == [True] * 3

    assert rank0.batch_get_v1(keys, page_indices(rank0_pool, 8, 3)) == [True] * 3
    assert rank1.batch_get_v1(keys, page_indices(rank1_pool, 8, 3)) == [True] * 3
    assert page_bytes(rank0_pool, 8, 3) == page_bytes(rank0_pool, 0, 3)
    assert page_bytes(rank1_pool, 8, 3) == page_bytes(rank1_pool, 0, 3)
    assert page_bytes(rank0_pool, 8, 3) != page_bytes(rank1_pool, 8, 3)

    # another TP degree splits heads differently: never reads these pages
    assert make_storage(filled(mha_host_pool, 3), tp_rank=0, tp_size=1).batch_exists(keys) == 0


@pytest.mark.parametrize("backend_spec", SHARED_BACKENDS, indirect=True)
def test_pipeline_stages_and_models_are_apart(make_storage) -> None:
    keys = page_keys(2)
    pool = filled(mha_host_pool, 4)
    stage0 = make_storage(pool, pp_rank=0, pp_size=2)
    assert stage0.batch_set_v1(keys, page_indices(pool, 0, 2)) == [True, True]
    assert make_storage(pool, pp_rank=0, pp_size=2).batch_exists(keys) == 2
    assert make_storage(pool, pp_rank=1, pp_size=2).batch_exists(keys) == 0
    assert make_storage(pool, pp_rank=0, pp_size=1).batch_exists(keys) == 0
    other_model = make_storage(pool, pp_rank=0, pp_size=2, model_name="other/model")
    # the test's namespace is explicit, and the model still separates it
    assert other_model.batch_exists(keys) == 0
    a = make_storage(pool, extra={"namespace": None}, model_name="org/a")
    b = make_storage(pool, extra={"namespace": None}, model_name="org/b")
    assert a.batch_set_v1(keys, page_indices(pool, 0, 2)) == [True, True]
    assert b.batch_exists(keys) == 0


@pytest.mark.parametrize("backend_spec", SHARED_BACKENDS, indirect=True)
def test_weight_versions_are_apart(make_storage) -> None:
    keys = page_keys(2)
    pool = filled(mha_host_pool, 5)
    v1 = make_storage(pool, extra={"weight_version": "v1"})
    assert v1.batch_set_v1(keys, page_indices(pool, 0, 2)) == [True, True]
    assert make_storage(pool, extra={"weight_version": "v2"}).batch_exists(keys) == 0
    assert make_storage(pool, extra={"weight_version": "v1"}).batch_exists(keys) == 2


@pytest.mark.parametrize("backend_spec", SHARED_BACKENDS, indirect=True)
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mla_pages_are_shared_and_written_by_the_writer_rank_only(
    make_storage, layout: str
) -> None:
    keys = page_keys(4)
    pools = [filled(lambda: mla_host_pool(layout), 10 + r) for r in range(2)]
    ranks = [make_storage(pools[r], tp_rank=r, tp_size=2, is_mla=True) for r in range(2)]
    assert ranks[0].storage_config.is_storage_writer
    assert not ranks[1].storage_config.is_storage_writer

    # the non-writer stores nothing and says what is stored: nothing yet
    assert ranks[1].batch_set_v1(keys, page_indices(pools[1], 0, 4)) == [False] * 4
    assert ranks[0].batch_exists(keys) == 0
    assert ranks[1].kvcore_stats()["pages_write_skipped"] == 4

    assert ranks[0].batch_set_v1(keys, page_indices(pools[0], 0, 4)) == [True] * 4
    # rank 1 reads rank 0's latent pages (MLA KV is the same on every TP rank)
    assert ranks[1].batch_exists(keys) == 4
    assert ranks[1].batch_get_v1(keys, page_indices(pools[1], 9, 4)) == [True] * 4
    assert page_bytes(pools[1], 9, 4) == page_bytes(pools[0], 0, 4)
    # and now that they are stored, the non-writer's set reports them stored
    assert ranks[1].batch_set_v1(keys, page_indices(pools[1], 0, 4)) == [True] * 4
