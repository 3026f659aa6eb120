"""Block digests: a backend that keeps no checksum can never hand the engine corrupt KV."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from memory_backend import MemoryBackend
from test_correctness import cache_of, keys, lay, part_bytes

import kvcore
from kvcore import hookimpl
from kvcore.testing import Harness, blocks_equal
from kvcore.transfer import TransferManager
from kvcore.transfer.integrity import DIGEST_PART


def manager(layout, cache, backend=MemoryBackend, **cfg) -> TransferManager:
    verify = cfg.get("verify_blocks", "auto")
    be = kvcore.open_backend(backend, context={"layout": layout}, verify_blocks=verify)
    tm = TransferManager({"layout": layout, "max_model_len": 64, **cfg}, cache, be)
    tm._test_backend = be
    return tm


def flip_a_bit(tm: TransferManager, block_key: str, part: str = "v") -> None:
    """Corrupt one stored object in place, as a failing store's memory would."""
    objects = tm._test_backend.plugin._objects
    name = next(n for n in objects if f"/{block_key}/{part}/" in n)
    data = bytearray(objects[name])
    data[len(data) // 2] ^= 0x10
    objects[name] = bytes(data)


@pytest.mark.parametrize("storage_io", ["staged", "host_resident"])
def test_a_corrupt_block_ends_the_run_is_removed_and_heals(storage_io):
    layout = lay()
    src = cache_of(layout, np.uint16, seed=1)
    tm = manager(layout, src, storage_io=storage_io)
    ks = keys(4, seed=1)
    assert tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": [0, 1, 2, 3]}).result().ok
    flip_a_bit(tm, ks[2])
    dst = cache_of(layout, np.uint16, fill=False)
    tm.restore_caches(dst)
    r = tm.read({"task_id": "r", "keys": ks, "device_block_ids": [4, 5, 6, 7]}).result()
    assert (r.num_blocks, r.block_ids, r.outcome) == (2, [4, 5], "corrupt")
    assert "block 2 differs from its digest" in r.error
    for s, d in zip([0, 1], [4, 5], strict=True):
        assert part_bytes(src, s) == part_bytes(dst, d)
    # the corrupt block is gone: the next write-back stores it again, and it reads back exact
    assert tm.query({"task_id": "q", "keys": ks}) == 2
    tm.restore_caches(src)
    w = tm.write_back({"task_id": "w2", "keys": ks, "device_block_ids": [0, 1, 2, 3]}).result()
    assert (w.skipped_blocks, w.num_blocks) == (2, 2)
    tm.restore_caches(dst)
    r = tm.read({"task_id": "r2", "keys": ks, "device_block_ids": [4, 5, 6, 7]}).result()
    assert r.num_blocks == 4 and part_bytes(src, 2) == part_bytes(dst, 6)
    assert tm.backend.stats()["corrupt_blocks.read"] == 1
    tm.close()
    tm._test_backend.close()


def test_without_digests_the_corrupt_bytes_would_reach_the_engine():
    """The control: the same flip, with verification off, lands in the cache."""
    layout = lay()
    src = cache_of(layout, np.uint16, seed=2)
    tm = manager(layout, src, verify_blocks="never")
    ks = keys(2, seed=2)
    tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": [0, 1]}).result()
    flip_a_bit(tm, ks[1])
    dst = cache_of(layout, np.uint16, fill=False)
    tm.restore_caches(dst)
    r = tm.read({"task_id": "r", "keys": ks, "device_block_ids": [4, 5]}).result()
    assert r.num_blocks == 2 and part_bytes(src, 1) != part_bytes(dst, 5)
    tm.close()
    tm._test_backend.close()


class _DigestsFail(MemoryBackend):
    """Stores parts, refuses digests: as if the process died between the two writes."""

    @hookimpl
    def kvcore_write(self, request):
        if request.parts == (DIGEST_PART,):
            return kvcore.Outcome(0, "disk full")
        return MemoryBackend.kvcore_write(self, request)


def test_a_block_without_its_digest_is_neither_acknowledged_nor_counted():
    layout = lay()
    tm = manager(layout, cache_of(layout, np.uint16, seed=3), backend=_DigestsFail)
    ks = keys(2, seed=3)
    w = tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": [0, 1]}).result()
    assert (w.num_blocks, w.outcome) == (0, "backend_error") and "disk full" in w.error
    assert tm.query({"task_id": "q", "keys": ks}) == 0
    tm.close()
    tm._test_backend.close()


def test_backends_that_verify_their_own_objects_get_no_digests(tmp_path):
    pytest.importorskip("kv_file")
    layout = lay()
    be = kvcore.open_backend("file", {"root": str(tmp_path)}, context={"layout": layout})
    tm = TransferManager({"layout": layout, "max_model_len": 64}, cache_of(layout, np.uint16), be)
    ks = keys(2, seed=4)
    assert tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": [0, 1]}).result().ok
    digests = be.request("q", ks, parts=(DIGEST_PART,))
    assert be.query(digests) == 0  # kv_file checks its own checksums: nothing beside
    tm.close()
    be.close()


class _QueriesSeen(MemoryBackend):
    """Records the parts of every query it answers."""

    queries: list[tuple[str, ...]]

    @hookimpl
    def kvcore_query(self, request):
        self.queries.append(request.parts)
        return MemoryBackend.kvcore_query(self, request)


def test_a_lookup_asks_the_backend_once_for_blocks_and_digests_together():
    """One round trip per lookup (a network store pays per call): the digest is asked as one
    more part of each block, and a block counts only with all its parts and its digest."""
    layout = lay()
    tm = manager(layout, cache_of(layout, np.uint16, seed=5), backend=_QueriesSeen)
    plugin = tm._test_backend.plugin
    plugin.queries = []
    ks = keys(4, seed=5)
    assert tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": [0, 1, 2, 3]}).result().ok
    plugin.queries.clear()
    assert tm.query({"task_id": "q", "keys": ks}) == 4
    assert plugin.queries == [("k", "v", DIGEST_PART)]
    # block 2's digest lost (its parts still stored): the run ends before it
    objects = plugin._objects
    del objects[next(n for n in objects if f"/{ks[2]}/{DIGEST_PART}/" in n)]
    plugin.queries.clear()
    assert tm.query({"task_id": "q2", "keys": ks}) == 2
    assert plugin.queries == [("k", "v", DIGEST_PART)]
    # and block 1's v part lost: the run ends before it, digest or not
    del objects[next(n for n in objects if f"/{ks[1]}/v/" in n)]
    assert tm.query({"task_id": "q3", "keys": ks}) == 1
    assert tm.query({"task_id": "q4", "keys": []}) == 0
    tm.close()
    tm._test_backend.close()


def test_a_short_write_never_removes_a_block_another_write_stored_whole():
    """A write that stops short (the store is full) must leave every object it did not create
    where it is: names are content-derived, so the digest a short write finds already stored
    is the digest of a block some other write (another thread, process or tier stack) stored
    whole and may already have reported as stored. Removing it as "unverified" made that
    block unreadable: a tier stack that had handed the block down then held it in no tier
    (issue 62, file over Mooncake with a stalled master: the background copy and the
    eviction hand-down of one block racing)."""
    layout = lay()
    store = kvcore.open_backend("memory", {"max_objects": 4}, context={"layout": layout})
    h = Harness(store, layout)
    seq = h.new_sequence(2)
    # block 1 stored whole by one write: its digest, K and V (3 of the 4 objects)
    assert h.write(seq, 1, 1) == 1
    assert h.read(seq, 1, 1)[0] == 1
    # another write of blocks 0 and 1: block 0's digest takes the last object, block 1's is
    # found stored, then block 0's K does not fit: nothing of block 0 or 1 is acknowledged
    assert h.write(seq) == 0
    done, got = h.read(seq, 1, 1)
    assert done == 1, "a short write removed the digest of a block stored whole before it"
    assert blocks_equal(got, h.payload(seq, 1, 1)) == []
    assert store.stats().get("blocks_done.remove_unverified", 0) == 0
    store.close()


class _ReadsSeen(MemoryBackend):
    """Records the parts and block count of every read it answers."""

    reads: list[tuple[tuple[str, ...], int]]

    @hookimpl
    def kvcore_read(self, request):
        self.reads.append((request.parts, request.num_blocks))
        return MemoryBackend.kvcore_read(self, request)


def _digest_and_data_reads(plugin: _ReadsSeen) -> tuple[list[int], list[int]]:
    """The block counts of the digest reads and of the data reads seen since the last call."""
    reads, plugin.reads = plugin.reads, []
    digests = [n for parts, n in reads if parts == (DIGEST_PART,)]
    return digests, [n for parts, n in reads if parts != (DIGEST_PART,)]


@pytest.mark.parametrize("storage_io", ["host_resident", "staged"])
def test_a_load_read_in_spans_reads_its_blocks_digests_once_and_still_checks_every_byte(
    storage_io,
):
    """A paced load reads in spans, one call each, so that a load falling behind is cut
    between two. Its blocks' digests are one read at its start, not one per span: each is a
    round trip (over Mooncake at 4 Gbit/s, 16 ms of the 24 ms that 24 spans cost beyond one
    call). A block corrupt in a later span still ends the run and is removed; a block whose
    digest is gone still ends it before its data is read."""
    layout = lay(num_blocks=40)
    src = cache_of(layout, np.uint16, seed=11)
    staged = {"pipeline_blocks": 2} if storage_io == "staged" else {}
    tm = manager(
        layout, src, backend=_ReadsSeen, storage_io=storage_io, max_model_len=32 * 40, **staged
    )
    plugin = tm._test_backend.plugin
    plugin.reads = []
    ks, ids = keys(32, seed=11), list(range(32))
    assert tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": ids}).result().ok

    def load(task_id: str) -> tuple:
        dst = cache_of(layout, np.uint16, fill=False)
        tm.restore_caches(dst)
        _digest_and_data_reads(plugin)
        task = {"task_id": task_id, "keys": ks, "device_block_ids": ids, "expected_s": 60.0}
        r = tm.read(task).result()
        for i in r.block_ids:  # every block the load reports is the one stored
            assert part_bytes(src, i) == part_bytes(dst, i)
        return r, *_digest_and_data_reads(plugin)

    r, digests, data = load("r")
    assert (r.outcome, r.num_blocks) == ("complete", 32)
    assert digests == [32] and len(data) > 1 and sum(data) == 32  # spans, one digest read
    flip_a_bit(tm, ks[20])
    r, digests, data = load("r2")
    assert (r.outcome, r.num_blocks) == ("corrupt", 20), r.error
    assert "block 20 differs from its digest" in r.error and digests == [32]
    assert tm.backend.stats()["corrupt_blocks.read"] == 1
    objects = plugin._objects
    assert not any(f"/{ks[20]}/" in n for n in objects)  # removed, data and digest
    del objects[next(n for n in objects if f"/{ks[10]}/{DIGEST_PART}/" in n)]
    r, digests, data = load("r3")
    assert r.num_blocks == 10 and r.block_ids == ids[:10]
    assert digests == [32] and sum(data) == 10  # block 10's data never read
    tm.close()
    tm._test_backend.close()


def test_within_a_read_in_spans_its_slices_take_the_digests_read_once_and_others_their_own():
    layout = lay()
    store = kvcore.open_backend("memory", context={"layout": layout})
    h = Harness(store, layout)
    a, b = h.new_sequence(4), h.new_sequence(2)
    assert h.write(a) == 4 and h.write(b) == 2
    whole, _ = h.read_request(a)

    def digest_reads() -> float:
        return store.stats()["calls.read_digests"]

    with store.reading_in_spans(whole):
        before = digest_reads()
        span, got = h.read_request(a, 1, 2)
        assert store.read(replace(span, task_id=whole.task_id)) == 2
        assert blocks_equal(got(), h.payload(a, 1, 2)) == []
        assert digest_reads() == before  # a slice of the load: its digests are at hand
        # another task's read of the same blocks, or the load's task reading other blocks:
        # each reads its own digests
        assert h.read(a, 1, 2)[0] == 2
        other, got = h.read_request(b)
        assert store.read(replace(other, task_id=whole.task_id)) == 2
        assert blocks_equal(got(), h.payload(b, 0, 2)) == []
        assert digest_reads() == before + 2
    # the scope is over: the load's task reads its digests again
    span, _ = h.read_request(a, 1, 2)
    assert store.read(replace(span, task_id=whole.task_id)) == 2
    assert digest_reads() == before + 3
    store.close()
