"""Bytes on disk stay within the capacity, eviction is LRU, and accounting survives restarts."""

from __future__ import annotations

import os
import threading
import time

import kv_file.objbatch
import kv_file.transfer
import pytest
from kv_file.index import Index
from kv_file.objfile import header_size
from kv_file_testutil import (
    LAYOUT,
    disk_bytes,
    forget_journal,
    object_files,
    object_paths,
    open_store,
    query,
    read_verified,
    with_own_files,
    write,
)

from kvcore.tenants import TenantSettings

KEY_LEN = len("default/kNN/k/r0of1")
OBJECT = header_size(KEY_LEN) + LAYOUT.part_bytes("k")  # one stored file
BLOCK = 2 * OBJECT


def four_blocks(root: str) -> dict[str, float]:
    """A store of four blocks that evicts down to 2.96 blocks (the capacity and the
    watermarks count the store's own files too)."""
    capacity = with_own_files(root, 4 * BLOCK)
    own = capacity - 4 * BLOCK
    return {
        "capacity_bytes": capacity,
        "high_watermark": 1.0,
        "low_watermark": (own + 0.74 * 4 * BLOCK) / capacity,
    }


def test_sustained_writes_stay_within_capacity(tmp_path) -> None:
    root = str(tmp_path / "s")
    objects = 10 * BLOCK + OBJECT // 2
    capacity = with_own_files(root, objects)
    store = open_store(root, capacity_bytes=capacity, high_watermark=1.0, low_watermark=0.8)
    own = int(store.stats()["backend_own_files_bytes"])
    assert own == capacity - objects
    peak = 0
    for i in range(40):
        assert write(store, [f"k{i:02d}"]) == 1
        on_disk = disk_bytes(root)
        peak = max(peak, on_disk)
        assert on_disk + own <= capacity + OBJECT, f"{on_disk} bytes on disk after write {i}"
        assert store.stats()["backend_bytes_used"] == on_disk
    stats = store.stats()
    assert stats["backend_evictions"] > 0
    assert peak > objects * 0.8, "the store should fill up before evicting"
    # the newest block is still there, the oldest is gone
    assert read_verified(store, ["k39"]) == 1
    assert store.query(store.request("q", ["k00"])) == 0
    store.close()


def test_a_read_refreshes_recency(tmp_path) -> None:
    root = str(tmp_path / "s")
    store = open_store(root, **four_blocks(root))
    assert write(store, ["a", "b", "c", "d"]) == 4
    assert read_verified(store, ["a"]) == 1  # a becomes the most recent
    _write_e_and_check_b_and_c_were_evicted(store)
    store.close()


def _write_e_and_check_b_and_c_were_evicted(store) -> None:
    """Blocks a-d fill a 4-block store; "a" is the most recently read."""
    assert write(store, ["e"]) == 1  # evicts down to 3 blocks: b and c go
    found = {k: query(store, [k]) for k in "abcde"}
    assert found == {"a": 1, "b": 0, "c": 0, "d": 1, "e": 1}


def test_a_read_in_an_earlier_run_keeps_its_recency(tmp_path) -> None:
    root = str(tmp_path / "s")
    cfg = four_blocks(root)
    store = open_store(root, **cfg)
    assert write(store, ["a", "b", "c", "d"]) == 4
    for age, key in enumerate("dcba"):  # distinct past mtimes: a oldest (same-tick writes tie)
        for path in object_paths(store, key):
            os.utime(path, ns=(0, time.time_ns() - (age + 1) * 10**9))
    mtimes = {p: os.stat(p).st_mtime_ns for p in object_files(root)}
    assert read_verified(store, ["a"]) == 1
    assert {p: os.stat(p).st_mtime_ns for p in object_files(root)} == mtimes, (
        "recency is saved in batches, not by a metadata write per read"
    )
    store.close()  # saves it
    reopened = open_store(root, **cfg)
    _write_e_and_check_b_and_c_were_evicted(reopened)
    reopened.close()


def test_recency_is_saved_by_the_background_scan(tmp_path) -> None:
    root = str(tmp_path / "s")
    store = open_store(root, rescan_interval_s=0.05)
    assert write(store, ["a", "b"]) == 2
    before = {p: os.stat(p).st_mtime_ns for p in object_files(root)}
    assert read_verified(store, ["a"]) == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        changed = [p for p in object_files(root) if os.stat(p).st_mtime_ns != before[p]]
        if len(changed) == 2:  # both parts of "a"
            break
        time.sleep(0.02)
    assert len(changed) == 2
    assert all(os.stat(p).st_mtime_ns > max(before.values()) for p in changed)
    store.close()


def test_accounting_and_recency_survive_a_restart(tmp_path) -> None:
    root = str(tmp_path / "s")
    cfg = four_blocks(root)
    store = open_store(root, **cfg)
    assert write(store, ["a", "b", "c", "d"]) == 4
    store.close()
    # without a journal (a store of kv_file < 0.3, or a lost journal) recency comes from
    # mtimes: make "a" the newest, as a read in an earlier run would have
    forget_journal(root)
    for i, path in enumerate(sorted(object_files(root), key=os.path.getmtime)):
        os.utime(path, ns=(0, 1_000_000_000 * (i + 1)))
    names = {os.path.basename(p) for p in object_files(root)}
    reopened = open_store(root, **cfg)
    for path in object_paths(reopened, "a"):
        os.utime(path, ns=(0, 10**18))
    reopened.close()
    forget_journal(root)
    reopened = open_store(root, **cfg)
    stats = reopened.stats()
    assert stats["backend_bytes_used"] == disk_bytes(root) == 4 * BLOCK
    assert stats["backend_objects"] == len(names) == 8
    assert write(reopened, ["e"]) == 1
    q = lambda k: reopened.query(reopened.request("q", [k]))  # noqa: E731
    assert q("a") == 1, "the most recently used block must survive eviction after a restart"
    assert q("e") == 1
    assert sum(q(k) for k in "bcd") <= 1, "older blocks are evicted first"
    reopened.close()


def test_lowered_capacity_evicts_at_the_first_call(tmp_path) -> None:
    # not while opening: a stack hands what this store evicts to the tier below, and attaches
    # that hand-over (kvcore_evict_to) right after opening, before any other call
    root = str(tmp_path / "s")
    store = open_store(root)
    assert write(store, [f"k{i}" for i in range(8)]) == 8
    store.close()
    small = open_store(root, capacity_bytes=with_own_files(root, 3 * BLOCK))
    assert disk_bytes(root) > 3 * BLOCK, "opening evicted"
    assert small.stats()["backend_bytes_used"] == disk_bytes(root) <= 3 * BLOCK
    small.close()
    handed: list[str] = []
    again = open_store(root, capacity_bytes=with_own_files(root, BLOCK))
    again.evict_to(lambda objects, deadline: handed.extend(n for n, _ in objects) or handed)
    assert handed, "what the first eviction took was not offered to the hand-over"
    assert disk_bytes(root) <= BLOCK
    again.close()


def test_an_object_larger_than_the_capacity_is_refused(tmp_path) -> None:
    store = open_store(str(tmp_path / "s"), capacity_bytes=OBJECT // 2)
    assert write(store, ["big"]) == 0
    assert store.stats()["backend_write_refused"] >= 1
    assert disk_bytes(str(tmp_path / "s")) == 0
    store.close()


def test_a_batch_larger_than_the_capacity_acknowledges_only_what_it_keeps(tmp_path) -> None:
    root = str(tmp_path / "s")
    capacity = with_own_files(root, 10 * BLOCK)
    store = open_store(root, capacity_bytes=capacity, high_watermark=1.0, low_watermark=0.5)
    keys = [f"big{i:02d}" for i in range(40)]
    acked = write(store, keys)
    assert 0 < acked <= 10, f"a 40-block batch into a 10-block store acknowledged {acked}"
    assert query(store, keys) == acked, "a query right after counts what write acknowledged"
    assert read_verified(store, keys) == acked
    assert disk_bytes(root) <= 10 * BLOCK
    assert store.stats()["backend_write_refused"] >= 1
    store.close()


def test_blocks_a_batch_skips_are_not_evicted_by_that_batch(tmp_path) -> None:
    # the stored blocks are the oldest in LRU order, and the batch overflows the store: what
    # the batch skipped (acknowledged as stored) must still be there when it returns
    root = str(tmp_path / "s")
    capacity = with_own_files(root, 10 * BLOCK)
    store = open_store(root, capacity_bytes=capacity, high_watermark=1.0, low_watermark=0.5)
    assert write(store, ["s0", "s1"]) == 2
    assert write(store, [f"mid{i}" for i in range(6)]) == 6
    batch = ["s0", "s1", *(f"new{i:02d}" for i in range(12))]
    acked = write(store, batch)
    assert acked >= 2
    assert query(store, batch) == acked
    assert read_verified(store, batch) == acked
    store.close()


def test_concurrent_writers_never_exceed_the_capacity(tmp_path, monkeypatch, io_path) -> None:
    # Deleting evicted files is slow here, so other writers run while victims are deleted.
    # Bytes on disk are tracked from the moment a write starts until the unlink of its file
    # returns (never less than what is there: a directory listing is not a snapshot), and
    # must stay within the capacity all along.
    root = str(tmp_path / "s")
    capacity = with_own_files(root, 10 * BLOCK)
    store = open_store(root, capacity_bytes=capacity, high_watermark=1.0, low_watermark=0.2)
    own = int(store.stats()["backend_own_files_bytes"])
    real_unlink, real_write = os.unlink, kv_file.transfer.write_object
    lock = threading.Lock()
    on_disk = [0]
    peak = [0]

    def account(delta: int) -> None:
        with lock:
            on_disk[0] += delta
            peak[0] = max(peak[0], on_disk[0])

    def slow_unlink(path, *args, **kwargs):
        # an evicted object is renamed to a temp name first, then unlinked
        size = os.path.getsize(path) if str(path).endswith((".kv", ".tmp")) else 0
        time.sleep(0.005)
        real_unlink(path, *args, **kwargs)
        account(-size)

    def counted_write(path, temp, name, pieces, **kwargs):
        size = header_size(len(name)) + sum(len(p) for p in pieces)
        account(size)
        try:
            return real_write(path, temp, name, pieces, **kwargs)
        except OSError:
            account(-size)
            raise

    class CountedBatch:
        """A batch of writes, its objects counted on disk from its start."""

        def __init__(self, batch, sizes) -> None:
            self.batch, self.sizes, self.size = batch, sizes, batch.size
            account(sum(sizes))

        def run(self) -> None:
            self.batch.run()

        def results(self):
            out = self.batch.results()
            account(-sum(s for s, code in zip(self.sizes, out[0], strict=True) if code != 0))
            return out

    def counted_batch(temps, paths, names, lengths, *args, **kwargs):
        sizes = [header_size(len(n)) + length for n, length in zip(names, lengths, strict=True)]
        return CountedBatch(real_batch(temps, paths, names, lengths, *args, **kwargs), sizes)

    real_batch = kv_file.objbatch.write_objects
    monkeypatch.setattr(os, "unlink", slow_unlink)
    monkeypatch.setattr(kv_file.transfer, "write_object", counted_write)
    monkeypatch.setattr(kv_file.objbatch, "write_objects", counted_batch)

    def writer(w: int) -> None:
        for i in range(30):
            write(store, [f"w{w}-{i}"])

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    monkeypatch.undo()
    assert store.stats()["backend_evictions"] >= 40
    assert peak[0] + own <= capacity, f"{(peak[0] + own) / capacity:.2f}x the capacity on disk"
    assert on_disk[0] == disk_bytes(root) == store.stats()["backend_bytes_used"]
    store.close()


def test_stores_sharing_a_root_come_back_within_the_capacity_after_a_rescan(tmp_path) -> None:
    # each process bounds the files it knows; after a rescan every process knows them all
    root = str(tmp_path / "s")
    capacity = with_own_files(root, 10 * BLOCK)
    cfg = {"capacity_bytes": capacity, "high_watermark": 1.0, "low_watermark": 0.8}
    a, b = open_store(root, **cfg), open_store(root, **cfg)
    assert write(a, [f"a{i}" for i in range(10)]) == 10
    assert write(b, [f"b{i}" for i in range(10)]) == 10
    assert disk_bytes(root) <= 2 * 10 * BLOCK
    for store in (a, b):
        store.plugin.rescan()
    assert disk_bytes(root) <= 10 * BLOCK
    a.close()
    b.close()


@pytest.mark.parametrize("shares", [False, True], ids=["one-lru", "tenants-shares"])
def test_a_write_refused_for_lack_of_room_evicts_nothing_for_what_it_refuses(shares) -> None:
    """Writes in flight (of this process or another) can hold more than evicting every
    unpinned object frees. The objects of a write that fit are admitted with the victims they
    need; one that does not fit even then is refused, and nothing is evicted for it: a
    refusal that first evicted everything it could lost the store's blocks for no write (a
    flood of concurrent writes emptied a store under load this way)."""
    size = 1000
    settings = None
    if shares:  # A's share covers what it holds, so only B's objects can go
        settings = TenantSettings(tenants={"A": {"reserved_bytes": 2 * size}, "B": {}})
    index = Index(10 * size, high=1.0, low=1.0, tenants=settings)
    stored = [(d, size, None, False, None, "B") for d in range(1, 9)]  # oldest first
    index.add_many(stored)
    in_flight = 7 * size
    # 8 stored + 7 in flight: the first object (1) fits once 6 are evicted; the second (3)
    # would need more than the 2 left, so it is refused and those 2 stay
    victims, admitted = index.plan_admission(in_flight, [size, 3 * size], tenant="B")
    assert admitted == 1
    assert victims == [1, 2, 3, 4, 5, 6]
    # nothing fits at all: nothing is evicted
    assert index.plan_admission(10 * size, [size], tenant="B") == ([], 0)
