"""Bytes on disk stay within the capacity, eviction is LRU, and accounting survives restarts."""

from __future__ import annotations

import os
import time

from kv_file.objfile import header_size
from kv_file_testutil import LAYOUT, disk_bytes, object_files, open_store, read_verified, write

KEY_LEN = len("default/kNN/k/r0of1")
OBJECT = header_size(KEY_LEN) + LAYOUT.part_bytes("k")  # one stored file
BLOCK = 2 * OBJECT


def test_sustained_writes_stay_within_capacity(tmp_path) -> None:
    root = str(tmp_path / "s")
    capacity = 10 * BLOCK + OBJECT // 2
    store = open_store(root, capacity_bytes=capacity, high_watermark=1.0, low_watermark=0.8)
    peak = 0
    for i in range(40):
        assert write(store, [f"k{i:02d}"]) == 1
        on_disk = disk_bytes(root)
        peak = max(peak, on_disk)
        assert on_disk <= capacity + OBJECT, f"{on_disk} bytes on disk after write {i}"
        assert store.stats()["backend_bytes_used"] == on_disk
    stats = store.stats()
    assert stats["backend_evictions"] > 0
    assert peak > capacity * 0.8, "the store should fill up before evicting"
    # the newest block is still there, the oldest is gone
    assert read_verified(store, ["k39"]) == 1
    assert store.query(store.request("q", ["k00"])) == 0
    store.close()


def test_a_read_refreshes_recency(tmp_path) -> None:
    store = open_store(
        str(tmp_path / "s"), capacity_bytes=4 * BLOCK, high_watermark=1.0, low_watermark=0.74
    )
    assert write(store, ["a", "b", "c", "d"]) == 4
    assert read_verified(store, ["a"]) == 1  # a becomes the most recent
    assert write(store, ["e"]) == 1  # evicts down to 3 blocks: b and c go
    q = lambda k: store.query(store.request("q", [k]))  # noqa: E731
    assert (q("a"), q("b"), q("c"), q("d"), q("e")) == (1, 0, 0, 1, 1)
    store.close()


def test_a_read_in_an_earlier_run_keeps_its_recency(tmp_path) -> None:
    root = str(tmp_path / "s")
    cfg = {"capacity_bytes": 4 * BLOCK, "high_watermark": 1.0, "low_watermark": 0.74}
    store = open_store(root, **cfg)
    assert write(store, ["a", "b", "c", "d"]) == 4
    for age, key in enumerate("dcba"):  # distinct past mtimes: a oldest (same-tick writes tie)
        for path in _paths_of(store, key):
            os.utime(path, ns=(0, time.time_ns() - (age + 1) * 10**9))
    mtimes = {p: os.stat(p).st_mtime_ns for p in object_files(root)}
    assert read_verified(store, ["a"]) == 1
    assert {p: os.stat(p).st_mtime_ns for p in object_files(root)} == mtimes, (
        "recency is saved in batches, not by a metadata write per read"
    )
    store.close()  # saves it
    reopened = open_store(root, **cfg)
    assert write(reopened, ["e"]) == 1  # evicts down to 3 blocks: b and c go
    q = lambda k: reopened.query(reopened.request("q", [k]))  # noqa: E731
    assert (q("a"), q("b"), q("c"), q("d"), q("e")) == (1, 0, 0, 1, 1)
    reopened.close()


def _paths_of(store, key: str) -> list[str]:
    from kv_file.objfile import encode_name
    from kv_file.paths import name_digest

    names = store.request("q", [key]).object_names[0]
    return [store.plugin._dir.object_path(name_digest(encode_name(n))) for n in names]


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
    cfg = {"capacity_bytes": 4 * BLOCK, "high_watermark": 1.0, "low_watermark": 0.74}
    store = open_store(root, **cfg)
    assert write(store, ["a", "b", "c", "d"]) == 4
    store.close()
    # recency lives in mtimes: make "a" the newest, as a read in an earlier run would have
    for i, path in enumerate(sorted(object_files(root), key=os.path.getmtime)):
        os.utime(path, ns=(0, 1_000_000_000 * (i + 1)))
    names = {os.path.basename(p) for p in object_files(root)}
    reopened = open_store(root, **cfg)
    reopened_a = reopened.request("q", ["a"]).object_names[0]
    for name in reopened_a:
        from kv_file.objfile import encode_name
        from kv_file.paths import name_digest

        path = reopened.plugin._dir.object_path(name_digest(encode_name(name)))
        os.utime(path, ns=(0, 10**18))
    reopened.close()
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


def test_lowered_capacity_evicts_at_open(tmp_path) -> None:
    root = str(tmp_path / "s")
    store = open_store(root)
    assert write(store, [f"k{i}" for i in range(8)]) == 8
    store.close()
    small = open_store(root, capacity_bytes=3 * BLOCK)
    assert disk_bytes(root) <= 3 * BLOCK
    assert small.stats()["backend_bytes_used"] == disk_bytes(root)
    small.close()


def test_an_object_larger_than_the_capacity_is_refused(tmp_path) -> None:
    store = open_store(str(tmp_path / "s"), capacity_bytes=OBJECT // 2)
    assert write(store, ["big"]) == 0
    assert store.stats()["backend_write_refused"] >= 1
    assert disk_bytes(str(tmp_path / "s")) == 0
    store.close()
