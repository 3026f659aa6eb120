"""The name snapshot lets a restarted store answer its first query without hashing names;
it is only a hint: damaged, lying or missing snapshots never cost data or correctness."""

from __future__ import annotations

import os

from kv_file.names import load_names, save_names
from kv_file.objfile import encode_name
from kv_file.paths import name_digest
from kv_file_testutil import object_files, open_store, read, read_verified, write

KEYS = [f"n{i}" for i in range(8)]


def _snapshot(root: str) -> str:
    return os.path.join(root, "default", "names.idx")


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


def test_a_damaged_snapshot_is_ignored(tmp_path) -> None:
    root = str(tmp_path / "s")
    store = open_store(root)
    assert write(store, KEYS) == len(KEYS)
    store.close()
    with open(_snapshot(root), "r+b") as f:
        f.seek(20)
        byte = f.read(1)[0]
        f.seek(20)
        f.write(bytes([byte ^ 0x40]))
    reopened = open_store(root)
    assert len(reopened.plugin._index.by_name) == 0
    assert reopened.query(reopened.request("q", KEYS)) == len(KEYS), "names are hashed instead"
    assert read_verified(reopened, KEYS) == len(KEYS)
    reopened.close()


def test_a_lying_snapshot_cannot_serve_another_objects_bytes(tmp_path) -> None:
    root = str(tmp_path / "s")
    store = open_store(root)
    assert write(store, ["real"]) == 1
    real = store.request("q", ["real"]).object_names[0]
    fake = store.request("q", ["fake"]).object_names[0]
    store.close()
    # map the digests of "real"'s files to "fake"'s names
    lies = [(name_digest(encode_name(r)), f) for r, f in zip(real, fake, strict=True)]
    save_names(_snapshot(root), _snapshot(root) + ".x.tmp", lies)
    reopened = open_store(root)
    done, _ = read(reopened, ["fake"])
    assert done == 0, "a header's name is checked on every read"
    assert read_verified(reopened, ["real"]) == 1, "the real object is intact and found"
    reopened.close()


def test_snapshot_round_trips_any_name(tmp_path) -> None:
    names = {1: "plain", 2**128 - 1: "new\nline\ttab", 7: "\udcff lone surrogate", 9: "x" * 70_000}
    path = str(tmp_path / "names.idx")
    assert save_names(path, path + ".tmp", names.items()) == len(names)
    assert load_names(path) == names
    with open(path, "r+b") as f:  # truncated: ignored as a whole
        f.truncate(os.path.getsize(path) - 1)
    assert load_names(path) == {}
    assert load_names(str(tmp_path / "missing")) == {}


def test_the_snapshot_follows_a_full_store_whose_name_count_stays_the_same(tmp_path) -> None:
    root = str(tmp_path / "s")
    probe = open_store(str(tmp_path / "probe"))
    assert write(probe, ["x"]) == 1
    one_block = sum(os.path.getsize(p) for p in object_files(str(tmp_path / "probe")))
    probe.close()
    cfg = {"capacity_bytes": one_block, "high_watermark": 1.0, "low_watermark": 0.5}
    store = open_store(root, **cfg)
    assert write(store, ["a"]) == 1
    store.close()
    store = open_store(root, **cfg)
    assert write(store, ["b"]) == 1  # evicts a: as many names as before, other ones
    store.close()
    reopened = open_store(root, **cfg)
    b_names = set(reopened.request("q", ["b"]).object_names[0])
    assert set(reopened.plugin._index.by_name) == b_names
    reopened.close()
