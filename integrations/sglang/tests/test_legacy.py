"""The legacy API (flat pages from get_data_page, or raw addresses) stores the same objects as
the v1 API: SGLang's generic copy path and its zero-copy path share pages."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_BACKENDS, page_bytes, page_indices, page_keys
from kvcore_sglang.testing import fill_random, mha_host_pool, mla_host_pool


def filled(layout: str = "page_first", seed: int = 1, mla: bool = False):
    pool = mla_host_pool(layout) if mla else mha_host_pool(layout)
    fill_random(pool, seed)
    return pool


def flat(pool, page: int) -> torch.Tensor:
    return pool.get_data_page(page * pool.page_size, flat=True)


@pytest.mark.parametrize("backend_spec", ALL_BACKENDS, indirect=True)
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_flat_pages_as_sglang_generic_path_moves_them(make_storage, layout: str) -> None:
    pool = filled(layout)
    storage = make_storage(pool)
    keys = page_keys(3)
    # SGLang's _generic_page_set: batch_set(keys, [get_data_page(i) ...])
    assert storage.batch_set(keys, [flat(pool, i) for i in range(3)]) is True
    assert storage.exists(keys[2]) is True
    assert storage.exists("not-stored") is False

    # SGLang's _generic_page_get: batch_get into dummy pages, then set_from_flat_data_page
    dummies = [pool.get_dummy_flat_data_page() for _ in range(4)]
    got = storage.batch_get([*keys, "not-stored"], dummies)
    assert got[:3] == dummies[:3] and got[3] is None
    for i in range(3):
        pool.set_from_flat_data_page(page_indices(pool, 12 + i, 1)[0], got[i])
    assert page_bytes(pool, 12, 3) == page_bytes(pool, 0, 3)

    # the v1 API reads what the legacy API wrote, and the other way round
    assert storage.batch_get_v1(keys, page_indices(pool, 20, 3)) == [True] * 3
    assert page_bytes(pool, 20, 3) == page_bytes(pool, 0, 3)
    more = page_keys(2, seed=5)
    assert storage.batch_set_v1(more, page_indices(pool, 4, 2)) == [True, True]
    target = pool.get_dummy_flat_data_page()
    assert storage.get(more[1], target) is target
    assert bytes(target.view(torch.uint8).numpy()) == page_bytes(pool, 5, 1)[0]


@pytest.mark.parametrize("backend_spec", ["memory"], indirect=True)
def test_single_page_calls_and_non_contiguous_targets(make_storage) -> None:
    pool = filled("layer_first", seed=2)
    storage = make_storage(pool)
    key = page_keys(1)[0]
    # a layer_first page is a strided view of the pool: stored through a contiguous copy
    page = pool.get_data_page(0, flat=False)
    assert not page.is_contiguous()
    assert storage.set(key, page) is True
    target = pool.get_data_page(9 * pool.page_size, flat=False)  # strided target, written back
    assert storage.get(key, target) is target
    assert page_bytes(pool, 9, 1) == page_bytes(pool, 0, 1)


@pytest.mark.parametrize("backend_spec", ["memory"], indirect=True)
@pytest.mark.parametrize("mla", [False, True])
def test_raw_addresses_as_the_mooncake_calling_convention(make_storage, mla: bool) -> None:
    pool = filled("page_first", seed=3, mla=mla)
    storage = make_storage(pool, is_mla=mla)
    keys = page_keys(2)
    ptrs, sizes = pool.get_page_buffer_meta(page_indices(pool, 0, 2))
    per_page = len(ptrs) // 2
    locations = [ptrs[i * per_page : (i + 1) * per_page] for i in range(2)]
    lengths = [sizes[i * per_page : (i + 1) * per_page] for i in range(2)]
    assert storage.batch_set(keys, None, locations, lengths) is True

    out = [torch.zeros(flat(pool, 0).numel(), dtype=pool.dtype) for _ in range(2)]
    whole = [t.data_ptr() for t in out]
    nbytes = [t.numel() * t.element_size() for t in out]
    assert storage.batch_get(keys, whole, nbytes) == 2
    assert [bytes(t.view(torch.uint8).numpy()) for t in out] == page_bytes(pool, 0, 2)
    assert storage.get("absent", whole[0], nbytes[0]) is None
    assert storage.set(keys[0], None, whole[0], nbytes[0]) is True


@pytest.mark.parametrize("backend_spec", ["memory"], indirect=True)
def test_clear_removes_every_page(make_storage) -> None:
    pool = filled(seed=4)
    storage = make_storage(pool)
    keys = page_keys(4)
    assert storage.batch_set_v1(keys, page_indices(pool, 0, 4)) == [True] * 4
    assert storage.clear() is True
    assert storage.batch_exists(keys) == 0
    # K and V of 4 pages, and on a backend without checksums the digest kvcore keeps beside
    # each page (kvcore.integrity)
    digests = 0 if storage._kv.backend.capabilities.checksums else 4
    assert storage.kvcore_stats()["objects_cleared"] == 8 + digests


@pytest.mark.parametrize("backend_spec", ["file"], indirect=True)
def test_clear_on_a_backend_without_it_says_so(make_storage) -> None:
    pool = filled(seed=5)
    storage = make_storage(pool)
    if storage._kv.backend.implements("kvcore_clear"):
        keys = page_keys(2)
        storage.batch_set_v1(keys, page_indices(pool, 0, 2))
        assert storage.clear() is True
        assert storage.batch_exists(keys) == 0
    else:
        assert storage.clear() is False
        assert storage.kvcore_stats()["failures.clear"] == 1
