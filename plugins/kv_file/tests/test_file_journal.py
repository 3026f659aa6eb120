"""The journal: every process's index is the same, a restarted store knows every name at once,
a damaged journal or none at all is rebuilt from the files, and compaction keeps it small."""

from __future__ import annotations

import os
from dataclasses import replace

from kv_file.journal import Journal, JournalError, Kind, Record, decode
from kv_file.objfile import header_size
from kv_file_testutil import (
    LAYOUT,
    forget_journal,
    object_files,
    open_store,
    read_verified,
    with_own_files,
    write,
)

from kvcore.keys import object_names
from kvcore.schemas import CacheLayout

KEYS = [f"n{i}" for i in range(8)]


def _journal(root: str) -> str:
    return os.path.join(root, "default", "journal")


def test_a_restarted_store_knows_every_name_at_open(tmp_path) -> None:
    root = str(tmp_path / "s")
    store = open_store(root)
    assert write(store, KEYS) == len(KEYS)
    store.close()
    reopened = open_store(root)
    assert len(reopened.plugin._index.by_name) == 2 * len(KEYS)  # K and V of each block
    assert reopened.query(reopened.request("q", KEYS)) == len(KEYS)
    assert read_verified(reopened, KEYS) == len(KEYS)
    reopened.close()
    assert not [n for n in os.listdir(os.path.join(root, "default")) if n.endswith(".tmp")]


def test_a_damaged_journal_is_rebuilt_from_the_files(tmp_path) -> None:
    root = str(tmp_path / "s")
    store = open_store(root)
    assert write(store, KEYS) == len(KEYS)
    store.close()
    with open(_journal(root), "r+b") as f:
        f.seek(4)
        f.write(b"\xff")  # a record's kind no reader knows
    reopened = open_store(root)
    stats = reopened.stats()
    assert stats["backend_journal_rebuilds"] == 1
    assert stats["backend_objects"] == 2 * len(KEYS)
    assert len(reopened.plugin._index.by_name) == 2 * len(KEYS)  # from the files' headers
    assert read_verified(reopened, KEYS) == len(KEYS)
    reopened.close()


def test_a_store_without_a_journal_is_adopted_with_its_names(tmp_path) -> None:
    """A store an older kv_file wrote (no journal): the files' own headers name them."""
    root = str(tmp_path / "s")
    store = open_store(root)
    assert write(store, KEYS) == len(KEYS)
    store.close()
    forget_journal(root)
    reopened = open_store(root)
    assert reopened.stats()["backend_adopted"] == 2 * len(KEYS)
    assert reopened.query(reopened.request("q", KEYS)) == len(KEYS)
    assert read_verified(reopened, KEYS) == len(KEYS)
    reopened.close()


def test_the_journal_follows_a_full_store(tmp_path) -> None:
    root = str(tmp_path / "s")
    probe = open_store(str(tmp_path / "probe"))
    assert write(probe, ["x"]) == 1
    one_block = sum(os.path.getsize(p) for p in object_files(str(tmp_path / "probe")))
    probe.close()
    capacity = with_own_files(root, one_block)
    cfg = {"capacity_bytes": capacity, "high_watermark": 1.0, "low_watermark": 0.5}
    store = open_store(root, **cfg)
    assert write(store, ["a"]) == 1
    store.close()
    store = open_store(root, **cfg)
    assert write(store, ["b"]) == 1  # evicts a
    store.close()
    reopened = open_store(root, **cfg)
    b_names = set(reopened.request("q", ["b"]).object_names[0])
    assert set(reopened.plugin._index.by_name) == b_names
    reopened.close()


def test_every_process_index_is_the_same_without_a_scan(tmp_path) -> None:
    root = str(tmp_path / "s")
    cfg = {"rescan_interval_s": 0}
    a, b = open_store(root, **cfg), open_store(root, **cfg)
    assert write(a, KEYS[:4]) == 4
    assert write(b, KEYS[4:]) == 4
    assert read_verified(a, KEYS[:1]) == 1  # a read: most recently used, for both
    a.plugin._catalog.sync()
    b.plugin._catalog.sync()
    assert list(a.plugin._index.lru) == list(b.plugin._index.lru)
    assert a.stats()["backend_bytes_used"] == b.stats()["backend_bytes_used"]
    assert b.remove(b.request("r", KEYS[:2])) == 2
    assert a.query(a.request("q", KEYS[:2])) == 0  # seen at once, no scan
    a.close()
    b.close()


def test_compaction_keeps_the_journal_small_and_the_order(tmp_path) -> None:
    root = str(tmp_path / "s")
    store = open_store(root, rescan_interval_s=0)
    assert write(store, KEYS) == len(KEYS)
    catalog = store.plugin._catalog
    for _ in range(4000):  # reads are recorded at most once a second per object: force them
        with catalog.journal.locked():
            catalog._catch_up()
            catalog._commit([Record(Kind.TOUCHED, d) for d in list(catalog.index.lru)[:2]])
    assert store.stats()["backend_journal_compactions"] >= 1
    assert os.path.getsize(_journal(root)) < 64 << 10
    order = list(catalog.index.lru)
    store.close()
    reopened = open_store(root)
    assert list(reopened.plugin._index.lru) == order
    assert read_verified(reopened, KEYS) == len(KEYS)
    reopened.close()


def test_a_journal_that_only_grew_is_not_rewritten(tmp_path) -> None:
    """A rewrite holds one stored record per object: a journal of a store that only grew is
    that already. It is rewritten once removals make it four times what it would hold."""
    root = str(tmp_path / "s")
    tiny = CacheLayout(num_layers=1, num_heads=1, block_size=1, head_dim=16)
    store = open_store(root, tiny, rescan_interval_s=0)
    catalog = store.plugin._catalog
    keys = [f"g{i}" for i in range(2400)]
    for start in range(0, len(keys), 200):
        assert write(store, keys[start : start + 200]) == 200
    assert os.path.getsize(_journal(root)) > catalog._compact_min  # past the least rewrite
    assert store.stats().get("backend_journal_compactions", 0) == 0
    # removals leave records about objects no longer there: then it is rewritten
    for start in range(0, 2300, 100):
        assert store.remove(store.request("r", keys[start : start + 100])) == 100
    assert store.stats()["backend_journal_compactions"] >= 1
    assert os.path.getsize(_journal(root)) < catalog._compact_min
    store.close()
    reopened = open_store(root, tiny)
    assert reopened.query(reopened.request("q", keys)) == 0  # the first block was removed
    assert reopened.query(reopened.request("q", keys[2300:])) == 100
    assert read_verified(reopened, keys[2300:]) == 100
    reopened.close()


def test_a_full_store_holds_as_many_objects_through_the_journals_cycles(tmp_path) -> None:
    """The journal grows with every write and shrinks at each rewrite; the room it leaves to
    objects must not. A full store of small objects with long names (the journal a large
    share of the store) is written through several rewrites: the objects it holds after each
    write stay within one write's worth, and the files on disk within the capacity.
    (Counting the journal at its current size, the store evicted objects for journal records
    as the journal grew and took as many new ones after each rewrite: 776-938 objects in
    turn here.)"""
    root = str(tmp_path / "s")
    tiny = CacheLayout(num_layers=1, num_heads=1, block_size=4, head_dim=8)
    capacity = 4 << 20
    store = open_store(
        root, tiny, rescan_interval_s=0, capacity_bytes=capacity,
        high_watermark=1.0, low_watermark=1.0,
    )  # fmt: skip
    per_write = 8  # blocks
    held: list[int] = []
    for w in range(600):
        keys = [f"c{w}-{i}-" + "x" * 180 for i in range(per_write)]  # records of ~250 bytes
        assert write(store, keys) == per_write
        if w >= 100:  # full by then (about 800 objects fit)
            held.append(int(store.stats()["backend_objects"]))
        if w >= 100 and w % 25 == 0:
            files = sum(os.path.getsize(p) for p in object_files(root))
            own = sum(  # what the file system allocated (the ledger is sparse)
                os.stat(os.path.join(root, "default", n)).st_blocks * 512
                for n in ("journal", "ledger")
            )
            assert files + own <= capacity, f"write {w}: {files} + {own} bytes"
    stats = store.stats()
    assert stats["backend_evictions"] > 0
    # the journal went through several rewrites while the objects were counted
    assert stats["backend_journal_compactions"] >= 3, stats["backend_journal_compactions"]
    assert max(held) - min(held) <= 2 * per_write * len(tiny.parts), (min(held), max(held))
    assert stats["backend_own_files_bytes_per_object"] > 0
    store.close()


def test_records_round_trip_and_damage_is_detected(tmp_path) -> None:
    records = [
        Record(Kind.STORED, 2**128 - 1, 4096, b"ns/" + b"x" * 70_000, 7),
        Record(Kind.TOUCHED, 5),
        Record(Kind.EVICTED, 9, origin=3),
    ]
    data = b"".join(r.encode() for r in records)
    assert decode(data) == records
    for cut in (3, 41, len(data) - 1):
        try:
            decode(data[:cut])
        except JournalError:
            continue
        raise AssertionError(f"a journal cut at byte {cut} parsed")


def test_a_dead_process_reservation_is_freed_by_a_scan(tmp_path) -> None:
    directory = tmp_path / "d"
    directory.mkdir()
    journal = Journal(str(directory), 1, lambda: str(directory / "j.tmp"))
    with journal.locked():
        journal.reserve(1000)
        # a slot of a process that is gone (pid 2**31-1 never runs)
        journal._map[64 + 32 : 64 + 64] = (
            (5).to_bytes(4, "little")
            + (2**31 - 1).to_bytes(4, "little")
            + (0).to_bytes(8, "little")
            + (777).to_bytes(8, "little")
            + bytes(8)
        )
        journal._map[32:36] = (2).to_bytes(4, "little")  # its claim raised the slots in use
        assert journal.reserved() == 1777
        assert journal.reap() == 777
        assert journal.reserved() == 1000
    journal.close()


def test_records_applied_together_leave_the_index_they_leave_one_at_a_time(tmp_path) -> None:
    """A batch's consecutive stored and touched records reach the index in one call each; a
    record of another kind between them keeps its place: the index ends the same as when
    every record is applied alone (LRU order, names, blocks, bytes, pins)."""
    names = [n for block in object_names(["b0", "b1", "b2"], ["k", "v"], namespace="default",
                                         rank=0, world_size=1) for n in block]  # fmt: skip
    size = header_size(len(names[0])) + LAYOUT.part_bytes("k")
    d = [1000 + i for i in range(len(names))]
    stored = [Record(Kind.STORED, d[i], size, n.encode(), 1) for i, n in enumerate(names)]
    records = [
        *stored[:4],
        Record(Kind.TOUCHED, d[0]),
        Record(Kind.TOUCHED, 77),  # not indexed: nothing happens
        stored[4],
        Record(Kind.GONE, d[4]),  # stored and gone within one batch
        Record(Kind.EVICTED, d[1]),
        Record(Kind.STORED, d[1], size, names[1].encode(), 1),  # back, most recent
        Record(Kind.TOUCHED, d[2]),
        Record(Kind.REMOVED, d[3]),
        stored[5],
        Record(Kind.STORED, d[0], size, None, 2),  # replaced in place: keeps its name
        Record(Kind.STORED, 5, size + 1, b"other", 1),  # another size: never named
    ]

    def index_after(apply) -> tuple:
        store = open_store(str(tmp_path / f"s{len(os.listdir(tmp_path))}"))
        catalog = store.plugin._catalog
        # origin 1: this store's own records (pinned when in ``pin``); 2: another process's
        apply(catalog, [replace(r, origin=catalog.token) if r.origin == 1 else r for r in records])
        index = catalog.index
        state = (
            [(k, e.size, e.name, e.block) for k, e in index.lru.items()],
            dict(index.by_name),
            {b: sorted(ds) for b, ds in index.blocks.items()},
            index.files_bytes,
            dict(index._pinned),
        )
        store.close()
        return state

    pin = frozenset({d[5], d[1]})
    together = index_after(lambda c, rs: c._apply(rs, pin=pin))
    alone = index_after(lambda c, rs: [c._apply([r], pin=pin) for r in rs])
    assert together == alone
    lru, by_name, blocks, _, pinned = together
    assert [k for k, *_ in lru] == [d[1], d[2], d[5], d[0], 5]
    assert by_name[names[0]] == d[0] and names[3] not in by_name and b"other" not in by_name
    assert sorted(blocks.values()) == [[d[0], d[1]], [d[2]], [d[5]]]
    assert pinned == {d[1]: 2, d[5]: 1}  # each own record pins (d1 twice); peers never
