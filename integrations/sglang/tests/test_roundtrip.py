"""Pages of SGLang's real host pools round-trip byte-exact through the v1 API, in every layout,
on every backend; stored objects are exactly the regions get_page_buffer_meta describes."""

from __future__ import annotations

import ctypes

import pytest
import torch
from conftest import ALL_BACKENDS, SHARED_BACKENDS, page_bytes, page_indices, page_keys
from kvcore_sglang.testing import fill_random, mha_host_pool, mla_host_pool

POOLS = [
    ("mha", "page_first"),
    ("mha", "layer_first"),
    ("mha", "page_first_direct"),
    ("mha", "page_head"),
    ("mla", "page_first"),
    ("mla", "layer_first"),
    ("mla", "page_first_direct"),
]


def build(kind: str, layout: str, seed: int = 1) -> object:
    pool = mha_host_pool(layout) if kind == "mha" else mla_host_pool(layout)
    fill_random(pool, seed)
    return pool


@pytest.mark.parametrize("backend_spec", ALL_BACKENDS, indirect=True)
@pytest.mark.parametrize(("kind", "layout"), POOLS)
def test_pages_round_trip_in_place(make_storage, kind: str, layout: str) -> None:
    pool = build(kind, layout)
    storage = make_storage(pool, is_mla=kind == "mla")
    keys = page_keys(6)
    written = page_bytes(pool, 0, 6)

    assert storage.batch_exists(keys) == 0
    assert storage.batch_set_v1(keys, page_indices(pool, 0, 6)) == [True] * 6
    assert storage.batch_exists(keys) == 6

    # read into other pages of the same pool: they hold different random bytes until then
    assert page_bytes(pool, 10, 6) != written
    assert storage.batch_get_v1(keys, page_indices(pool, 10, 6)) == [True] * 6
    assert page_bytes(pool, 10, 6) == written


@pytest.mark.parametrize("backend_spec", SHARED_BACKENDS, indirect=True)
@pytest.mark.parametrize(("kind", "layout"), POOLS)
def test_a_fresh_engine_reads_what_another_wrote(make_storage, kind: str, layout: str) -> None:
    writer_pool = build(kind, layout, seed=2)
    keys = page_keys(4, seed=3)
    assert (
        make_storage(writer_pool, is_mla=kind == "mla").batch_set_v1(
            keys, page_indices(writer_pool, 3, 4)
        )
        == [True] * 4
    )

    reader_pool = build(kind, layout, seed=4)
    reader = make_storage(reader_pool, is_mla=kind == "mla")
    assert reader.batch_exists(keys) == 4
    assert reader.batch_get_v1(keys, page_indices(reader_pool, 0, 4)) == [True] * 4
    assert page_bytes(reader_pool, 0, 4) == page_bytes(writer_pool, 3, 4)


@pytest.mark.parametrize("backend_spec", ["memory"], indirect=True)
@pytest.mark.parametrize(("kind", "layout"), POOLS)
def test_stored_objects_are_the_regions_of_get_page_buffer_meta(
    make_storage, kind: str, layout: str
) -> None:
    pool = build(kind, layout, seed=5)
    storage = make_storage(pool, is_mla=kind == "mla")
    keys = page_keys(3, seed=6)
    indices = page_indices(pool, 7, 3)
    assert storage.batch_set_v1(keys, indices) == [True] * 3

    # SGLang's own description of those pages: every region, in its order
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    nparts = 1 if kind == "mla" else 2
    per_page = len(ptrs) // 3
    for i, key in enumerate(keys):
        page = slice(i * per_page, (i + 1) * per_page)
        regions = list(zip(ptrs[page], sizes[page], strict=True))
        want = b"".join(
            ctypes.string_at(p, n) for j in range(nparts) for p, n in regions[j::nparts]
        )
        stored = torch.zeros(len(want), dtype=torch.uint8)
        assert storage.get(key, stored) is stored
        assert bytes(stored.numpy()) == want


@pytest.mark.parametrize("backend_spec", ["file"], indirect=True)
def test_layer_first_and_page_first_direct_share_pages(make_storage) -> None:
    # both lay a part out [layer, page, head, dim]; page_first ([page, layer, ...]) does not
    lf = build("mha", "layer_first", seed=7)
    keys = page_keys(2, seed=8)
    assert make_storage(lf).batch_set_v1(keys, page_indices(lf, 0, 2)) == [True] * 2

    pfd = build("mha", "page_first_direct", seed=9)
    assert make_storage(pfd).batch_get_v1(keys, page_indices(pfd, 5, 2)) == [True] * 2
    assert page_bytes(pfd, 5, 2) == page_bytes(lf, 0, 2)

    pf = build("mha", "page_first", seed=10)
    assert make_storage(pf).batch_exists(keys) == 0


@pytest.mark.parametrize("backend_spec", ALL_BACKENDS, indirect=True)
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_partial_hits_are_a_leading_run(make_storage, layout: str) -> None:
    pool = build("mha", layout, seed=11)
    storage = make_storage(pool)
    keys = page_keys(8, seed=12)
    # pages 0, 1, 3 and 4 stored; page 2 missing
    assert storage.batch_set_v1(keys[:2], page_indices(pool, 0, 2)) == [True, True]
    assert storage.batch_set_v1(keys[3:5], page_indices(pool, 3, 2)) == [True, True]

    assert storage.batch_exists(keys) == 2
    assert storage.batch_exists(keys[3:]) == 2
    got = storage.batch_get_v1(keys, page_indices(pool, 20, 8))
    assert got == [True, True] + [False] * 6
    assert page_bytes(pool, 20, 2) == page_bytes(pool, 0, 2)


@pytest.mark.parametrize("backend_spec", ["memory"], indirect=True)
def test_unaligned_layer_first_pages_are_staged_correctly(make_storage) -> None:
    # SGLang allocates pages at page-aligned slots; any contiguous run of slots still works
    pool = build("mha", "layer_first", seed=13)
    storage = make_storage(pool)
    keys = page_keys(2, seed=14)
    start = 5  # slot 5: not a page boundary
    indices = torch.arange(start, start + 2 * pool.page_size)
    assert storage.batch_set_v1(keys, indices) == [True, True]
    flat = [pool.get_data_page(start + i * pool.page_size).contiguous() for i in range(2)]
    assert storage.batch_get_v1(keys, page_indices(pool, 12, 2)) == [True, True]
    assert page_bytes(pool, 12, 2) == [bytes(f.view(torch.uint8).numpy()) for f in flat]


@pytest.mark.parametrize("backend_spec", ALL_BACKENDS, indirect=True)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_layer_first_goes_in_place_when_the_backend_takes_segments(make_storage, kind) -> None:
    pool = build(kind, "layer_first", seed=15)
    storage = make_storage(pool, is_mla=kind == "mla")
    keys = page_keys(3, seed=16)
    assert storage.batch_set_v1(keys, page_indices(pool, 0, 3)) == [True] * 3
    assert storage.batch_get_v1(keys, page_indices(pool, 4, 3)) == [True] * 3
    assert page_bytes(pool, 4, 3) == page_bytes(pool, 0, 3)
    segmented = storage._kv.backend.capabilities.segmented_host
    # segmented: kvcore gets the per-layer regions themselves; otherwise one staging copy
    assert storage.kvcore_stats().get("pages_staged", 0) == (0 if segmented else 6)


@pytest.mark.parametrize("backend_spec", ["file"], indirect=True)
def test_every_page_is_the_engines_tenant_where_tenants_are_set(make_storage) -> None:
    # SGLang's storage calls carry no request (no salt): one tenant per engine, the settings'
    pool = build("mha", "page_first")
    storage = make_storage(pool, extra={"tenants": {"default_tenant": "team-x"}})
    keys = page_keys(4)
    assert storage.batch_set_v1(keys, page_indices(pool, 0, 4)) == [True] * 4
    assert storage.batch_exists(keys) == 4
    stats = storage.kvcore_stats()
    assert stats["kv.tenant_blocks_done.query.team-x"] >= 4
    assert stats["kv.tenant_blocks_done.write.team-x"] == 4
