"""A damaged file is a counted miss, is removed, and the key can be written again."""

from __future__ import annotations

import os

import pytest
from kv_file.objfile import HEADER, PAGE, header_size
from kv_file_testutil import object_files, open_store, read, read_verified, write


@pytest.fixture
def store(tmp_path):
    b = open_store(str(tmp_path / "s"))
    yield b
    b.close()


def _file_of(store, key: str, part: int = 0) -> str:
    from kv_file.objfile import encode_name
    from kv_file.paths import name_digest

    name = store.request("x", [key]).object_names[0][part]
    return store.plugin._dir.object_path(name_digest(encode_name(name)))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def _payload_offset(store, key: str) -> int:
    name = store.request("x", [key]).object_names[0][0]
    return header_size(len(name.encode()))


@pytest.mark.parametrize(
    "damage",
    [
        "payload_bit",
        "last_byte",
        "name_bit",
        "length_field",
        "magic",
        "truncate",
        "extend",
        "empty",
    ],
)
def test_damaged_object_is_a_removed_counted_miss(store, damage: str) -> None:
    keys = ["b0", "b1", "b2"]
    assert write(store, keys) == 3
    path = _file_of(store, "b1")
    size = os.path.getsize(path)
    off = _payload_offset(store, "b1")
    if damage == "payload_bit":
        _flip(path, off + 1234)
    elif damage == "last_byte":
        _flip(path, size - 1)
    elif damage == "name_bit":
        _flip(path, HEADER.size + 3)
    elif damage == "length_field":
        _flip(path, 12)  # low byte of the u64 payload length
    elif damage == "magic":
        _flip(path, 0)
    elif damage == "truncate":
        os.truncate(path, size - PAGE)
    elif damage == "extend":
        with open(path, "ab") as f:
            f.write(b"\0" * 8)
    elif damage == "empty":
        os.truncate(path, 0)

    assert read_verified(store, keys) == 1
    assert not os.path.exists(path), "a corrupt file must be removed"
    assert store.stats()["backend_corrupt_removed"] == 1
    assert store.query(store.request("q", keys)) == 1, "the index must forget it"
    # the key heals: written again, read again
    assert write(store, keys) == 3
    assert read_verified(store, keys) == 3


def test_other_size_is_a_miss_that_keeps_the_file(tmp_path) -> None:
    from kvcore import CacheLayout

    root = str(tmp_path / "s")
    small = CacheLayout(num_layers=1, num_heads=1, block_size=4, head_dim=8)
    big = CacheLayout(num_layers=2, num_heads=1, block_size=4, head_dim=8)
    a = open_store(root, small)
    assert write(a, ["k"]) == 1
    a.close()
    b = open_store(root, big)
    assert read(b, ["k"])[0] == 0
    assert b.stats().get("backend_corrupt_removed", 0) == 0
    b.close()
    a = open_store(root, small)
    assert read_verified(a, ["k"]) == 1, "the valid object must survive a wrong-size read"
    a.close()


def test_hash_collision_is_a_miss_not_the_wrong_object(store) -> None:
    assert write(store, ["victim"]) == 1
    src = _file_of(store, "victim", 0)
    # pretend the name "other" hashed to the same file: its read must not return victim's bytes
    dst = _file_of(store, "other", 0)
    os.replace(src, dst)
    assert read(store, ["other"])[0] == 0
    assert os.path.exists(dst), "a valid object of another name is not corrupt"
    assert store.stats()["backend_read_collisions"] == 1


def test_object_files_hold_raw_bytes_not_pickles(store) -> None:
    assert write(store, ["raw"]) == 1
    for path in object_files(store.plugin._dir.path):
        with open(path, "rb") as f:
            head = f.read(4)
        assert head == b"KVCF"
