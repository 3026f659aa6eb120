"""A damaged file is a counted miss, is removed, and the key can be written again."""

from __future__ import annotations

import os

import pytest
from kv_file.objfile import HEADER, PAGE, header_size
from kv_file_testutil import (
    host_for,
    object_files,
    object_path,
    open_store,
    payload,
    query,
    read,
    read_verified,
    write,
)

from kvcore import CacheLayout, HostBuffers

#: every test here runs on both I/O paths: native (kvcore.fileio) and Python
pytestmark = pytest.mark.usefixtures("io_path")


@pytest.fixture
def store(tmp_path):
    b = open_store(str(tmp_path / "s"))
    yield b
    b.close()


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
    path = object_path(store, "b1")
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


def test_an_object_of_another_size_is_removed_and_replaced(tmp_path) -> None:
    # the same names under another layout (another engine sharing the namespace, or a short
    # object a buggy caller wrote): never counted, removed on sight, and a rewrite lands
    root = str(tmp_path / "s")
    small = CacheLayout(num_layers=1, num_heads=1, block_size=4, head_dim=8)
    big = CacheLayout(num_layers=2, num_heads=1, block_size=4, head_dim=8)
    a = open_store(root, small)
    assert write(a, ["k"]) == 1
    a.close()
    b = open_store(root, big)
    assert query(b, ["k"]) == 0, "an object of another size must not be counted"
    assert read(b, ["k"])[0] == 0
    assert b.stats()["backend_foreign_removed"] >= 1, "the object of another size is removed"
    assert b.stats().get("backend_corrupt_removed", 0) == 0
    assert write(b, ["k"]) == 1, "a rewrite replaces every part of another size"
    assert read_verified(b, ["k"]) == 1
    big_object = header_size(len(b.request("q", ["k"]).object_names[0][0])) + big.part_bytes("k")
    assert [os.path.getsize(p) for p in object_files(root)] == [big_object] * 2
    b.close()


def test_a_read_into_a_buffer_of_another_size_keeps_the_object(store) -> None:
    # the caller's buffer is wrong, not the stored object (of the layout's size): a plain miss
    assert write(store, ["k"]) == 1
    arrays = payload(store, ["k"])
    right = host_for(arrays, 1)
    shrunk = HostBuffers(ptrs=right.ptrs, nbytes=tuple(n - PAGE for n in right.nbytes))
    req = store.request("r", ["k"], host=shrunk)
    assert store.plugin.kvcore_read(request=req) == 0
    assert len(object_files(store.plugin._dir.path)) == 2
    assert read_verified(store, ["k"]) == 1


def test_a_misplaced_object_is_a_miss_and_is_removed(store) -> None:
    assert write(store, ["victim", "other"]) == 2
    # victim's file moved over other's: a valid object, but not the one this file must hold
    os.replace(object_path(store, "victim", 0), object_path(store, "other", 0))
    assert read(store, ["other"])[0] == 0, "a read must never return another object's bytes"
    assert not os.path.exists(object_path(store, "other", 0))
    assert store.stats()["backend_foreign_removed"] == 1
    assert query(store, ["other"]) == 0
    assert write(store, ["other"]) == 1
    assert read_verified(store, ["other"]) == 1


def test_object_files_hold_raw_bytes_not_pickles(store) -> None:
    assert write(store, ["raw"]) == 1
    for path in object_files(store.plugin._dir.path):
        with open(path, "rb") as f:
            head = f.read(4)
        assert head == b"KVCF"
