"""FastDeploy's storage flows (read, write-back, flush-only), replayed against the adapter.

Each test drives ``KVCoreStore`` the way the patched cache transfer manager does (see
``fd_flows.py``), with Paddle cache tensors, on kv_file, kv_mooncake (a real master on
127.0.0.1) and kvcore's in-process ``memory`` backend, and checks what matters to FastDeploy:
the bytes that land in its cache, and the block ids it reports.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fd_flows import FastDeployRank
from kvcore_fastdeploy import FAILED, NOT_FOUND, KVCoreStore

import kvcore

BACKENDS = ["memory", "file", "mooncake"]


def _hashes(n: int, salt: str = "") -> list[str]:
    """Block hashes as FastDeploy's prefix cache makes them: hex digests of the token path."""
    tokens = [hash((salt, i)) % 150_000 for i in range(n * 16)]
    return kvcore.block_hashes(tokens, 16, kvcore.KeyScope(model=f"fd-flows-{salt}"))


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "block_wise_fp8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_write_back_then_read_restores_every_byte(
    open_store: Callable[..., KVCoreStore], backend: str, cache_dtype: str
) -> None:
    store = open_store(backend, cache_dtype=cache_dtype)
    writer = FastDeployRank(store, store.layout)
    reader = FastDeployRank(store, store.layout)  # another request's cache: all zeros
    hashes = _hashes(5, f"{backend}-{cache_dtype}")
    src_ids, dst_ids = [3, 1, 7, 0, 12], [4, 9, 2, 20, 6]
    writer.fill(src_ids, seed=1)

    wrote = writer.write_back(hashes, src_ids)
    got = reader.read(hashes, dst_ids)

    assert (wrote.matched, wrote.written) == (0, src_ids)
    assert set(wrote.answers) == {0}, "batch_set stored every object"
    assert (got.matched, got.restored) == (5, dst_ids)
    parts = 4 if cache_dtype == "block_wise_fp8" else 2
    assert got.answers == [store.layout.part_bytes("k")] * 10 + (
        [store.layout.part_bytes("k_scale")] * 10 if parts == 4 else []
    )
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert reader.block_bytes(d) == writer.block_bytes(s), f"block {s} -> {d}"
    untouched = sorted(set(range(24)) - set(dst_ids))
    assert not any(any(b.strip(b"\0") for b in reader.block_bytes(i)) for i in untouched)


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_another_process_reads_what_one_wrote(
    open_store: Callable[..., KVCoreStore], backend: str
) -> None:
    """Two stores opened apart (two FastDeploy deployments on one store) share the blocks."""
    first = open_store(backend)
    writer = FastDeployRank(first, first.layout)
    hashes = _hashes(4, f"share-{backend}")
    writer.fill([5, 6, 7, 8], seed=2)
    assert writer.write_back(hashes, [5, 6, 7, 8]).written == [5, 6, 7, 8]

    second = open_store(backend)
    reader = FastDeployRank(second, second.layout)
    got = reader.read(hashes, [0, 1, 2, 3])
    assert got.restored == [0, 1, 2, 3]
    assert [reader.block_bytes(i) for i in range(4)] == [
        writer.block_bytes(i) for i in (5, 6, 7, 8)
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_back_skips_the_stored_prefix(
    open_store: Callable[..., KVCoreStore], backend: str
) -> None:
    store = open_store(backend)
    rank = FastDeployRank(store, store.layout)
    hashes = _hashes(6, f"skip-{backend}")
    ids = [10, 11, 12, 13, 14, 15]
    rank.fill(ids, seed=3)
    assert rank.write_back(hashes[:3], ids[:3]).written == ids[:3]
    written_before = store.stats().get("blocks_done.write", 0)

    again = rank.write_back(hashes, ids)

    assert (again.matched, again.written) == (3, ids[3:])
    assert store.stats()["blocks_done.write"] - written_before == 3, "only the new suffix"
    assert rank.write_back(hashes, ids).written == [], "all stored: nothing to write"
    assert FastDeployRank(store, store.layout).read(hashes, ids).restored == ids


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_restores_only_the_leading_run(
    open_store: Callable[..., KVCoreStore], backend: str
) -> None:
    """Blocks 0-1 and 3-4 stored, block 2 not: a read restores 0-1 and leaves the rest alone."""
    store = open_store(backend)
    writer = FastDeployRank(store, store.layout)
    hashes = _hashes(5, f"gap-{backend}")
    writer.fill([0, 1, 2, 3, 4], seed=4)
    writer.write_back(hashes[:2], [0, 1])
    # blocks 3 and 4 alone, as a batch_set of their own (staged from the cache first)
    tail = writer.names(hashes[3:])
    writer._swap([3, 4], [0, 1], 0)
    keys, locations, sizes = writer._batch(tail, [0, 1], write=True)
    assert set(store.batch_set(keys, locations, sizes)) == {0}

    reader = FastDeployRank(store, store.layout)
    got = reader.read(hashes, [5, 6, 7, 8, 9])

    assert (got.matched, got.restored) == (2, [5, 6])
    assert [reader.block_bytes(i) for i in (5, 6)] == [writer.block_bytes(i) for i in (0, 1)]
    assert not any(any(b.strip(b"\0") for b in reader.block_bytes(i)) for i in (7, 8, 9))
    assert reader.read(hashes[3:], [10, 11]).restored == [10, 11], "3-4 are there all the same"


def test_a_removed_object_ends_the_run(open_store: Callable[..., KVCoreStore]) -> None:
    """delete (kvcore_remove) of one object: its block and every later one are misses."""
    store = open_store("memory")
    writer = FastDeployRank(store, store.layout)
    hashes = _hashes(4, "removed")
    writer.fill([0, 1, 2, 3], seed=8)
    writer.write_back(hashes, [0, 1, 2, 3])
    assert store.delete(writer.names(hashes)["v"][1]) is True
    assert store.delete(writer.names(hashes)["v"][1]) is False, "already gone"
    assert FastDeployRank(store, store.layout).read(hashes, [4, 5, 6, 7]).restored == [4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_flush_only_touches_no_storage(
    open_store: Callable[..., KVCoreStore], backend: str
) -> None:
    """FD_AS_ONLY_FLUSH=1: write-back reports nothing and stores nothing for a key backend."""
    store = open_store(backend)
    rank = FastDeployRank(store, store.layout, as_only_flush=True)
    hashes = _hashes(3, f"flush-{backend}")
    rank.fill([0, 1, 2], seed=5)
    calls_before = {k: v for k, v in store.stats().items() if k.startswith("calls.")}

    result = rank.write_back(hashes, [0, 1, 2])

    assert (result.written, result.storage_calls) == ([], 0)
    calls_after = {k: v for k, v in store.stats().items() if k.startswith("calls.")}
    assert calls_after == calls_before
    assert FastDeployRank(store, store.layout).read(hashes, [3, 4, 5]).restored == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_and_weight_versions_name_objects_apart(
    open_store: Callable[..., KVCoreStore], backend: str
) -> None:
    store0 = open_store(backend, tp_rank=0, tp_size=2)
    rank0 = FastDeployRank(store0, store0.layout, rank=0, key_prefix="RL-STEP3")
    hashes = _hashes(2, f"ranks-{backend}")
    rank0.fill([0, 1], seed=6)
    rank0.write_back(hashes, [0, 1])

    same = FastDeployRank(store0, store0.layout, rank=0, key_prefix="RL-STEP3")
    assert same.read(hashes, [2, 3]).restored == [2, 3]
    other_step = FastDeployRank(store0, store0.layout, rank=0, key_prefix="RL-STEP4")
    assert other_step.read(hashes, [2, 3]).matched == 0, "new weights never read old KV"
    other_rank = FastDeployRank(store0, store0.layout, rank=1, key_prefix="RL-STEP3")
    assert other_rank.read(hashes, [2, 3]).matched == 0, "rank 1 holds other heads"


def test_a_full_backend_is_a_miss_never_an_exception(
    open_store: Callable[..., KVCoreStore],
) -> None:
    # 12 objects: the digests of the 4 blocks' K and V first (kvcore.integrity), then the K
    # and V of 2 of them; the digests of the 2 blocks without data stay (a short write removes
    # nothing: another writer may have stored those blocks whole meanwhile)
    store = open_store("memory", config={"max_objects": 12})
    rank = FastDeployRank(store, store.layout)
    hashes = _hashes(4, "full")
    rank.fill([0, 1, 2, 3], seed=7)

    wrote = rank.write_back(hashes, [0, 1, 2, 3])

    # FastDeploy reports what it handed over; the answers say blocks 2 and 3 were not stored
    assert wrote.written == [0, 1, 2, 3]
    assert wrote.answers == [0, 0, FAILED, FAILED] * 2
    got = FastDeployRank(store, store.layout).read(hashes, [4, 5, 6, 7])
    assert (got.matched, got.restored) == (2, [4, 5])
    assert store.stats()["failures_reported.write"] == 1
    assert store.stats().get("blocks_done.remove_unverified", 0) == 0


def test_a_missing_block_answers_not_found(open_store: Callable[..., KVCoreStore]) -> None:
    store = open_store("memory")
    layout = store.layout
    keys = FastDeployRank(store, layout).names(_hashes(2, "nf"))
    rank = FastDeployRank(store, layout)
    locations = [rank.read_buf.ptr + i * layout.part_bytes("k") for i in range(4)]
    answers = store.batch_get(
        keys=keys["k"] + keys["v"], target_locations=locations, target_sizes=[rank.stride] * 4
    )
    assert answers == [NOT_FOUND] * 4
