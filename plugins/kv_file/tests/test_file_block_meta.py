"""A block's metadata in its object's header: byte-identical files on both I/O paths, a
flipped bit makes it None (never other bytes) without costing the payload, what does not fit
beside the name is left out, and a reader that predates it reads the object unchanged."""

from __future__ import annotations

import os

import pytest
from kv_file.objfile import HEADER, Header, header_size, meta_fits
from kv_file_testutil import host_for, object_path, open_store, payload, read_verified

import kvcore

pytestmark = pytest.mark.usefixtures("io_path")

META = [b"block-0 says: hash 0x01, parent none", b"block-1 says: hash 0x02, parent 0x01"]


def _write(store: kvcore.Backend, keys: list[str], metas: list[bytes] | None) -> int:
    arrays = payload(store, keys)
    request = store.request("w", keys, host=host_for(arrays, len(keys)), block_meta=metas)
    return store.write(request)


def _describe(store: kvcore.Backend, keys: list[str]) -> list[bytes | None]:
    return store.describe(store.request("d", keys))


def test_metadata_is_kept_in_the_header_and_verified_on_its_own(tmp_path) -> None:
    store = open_store(str(tmp_path / "s"))
    keys = ["b0", "b1"]
    assert _write(store, keys, META) == 2
    assert _describe(store, keys) == META
    path = object_path(store, "b1")
    name = store.request("x", ["b1"]).object_names[0][0].encode()
    # the object's size does not depend on its metadata
    assert os.path.getsize(path) == header_size(len(name)) + store.context.layout.part_bytes("k")
    with open(path, "r+b") as f:  # flip a bit of the metadata
        f.seek(HEADER.size + len(name) + 8 + 5)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x04]))
    assert _describe(store, keys) == [META[0], None]
    # the payload's checksum does not cover the metadata: the block still reads, verified
    assert read_verified(store, keys) == 2
    store.close()


def test_both_io_paths_write_the_same_file(tmp_path, monkeypatch) -> None:
    """Byte for byte, the write stamp included (it is made of the block's bytes)."""
    from kv_file import objio

    files = []
    for native in (True, False):
        monkeypatch.setattr(objio, "native_io", native)
        store = open_store(str(tmp_path / f"s{native}"))
        assert _write(store, ["b0"], META[:1]) == 1
        with open(object_path(store, "b0"), "rb") as f:
            files.append(f.read())
        store.close()
    assert files[0] == files[1]
    stamp_at = header_size(HEADER.unpack_from(files[0])[3]) - 8
    assert files[0][stamp_at : stamp_at + 8] != bytes(8)


def test_metadata_that_does_not_fit_beside_the_name_is_left_out(tmp_path) -> None:
    store = open_store(str(tmp_path / "s"))
    name_len = len(store.request("x", ["b0"]).object_names[0][0].encode())
    room = header_size(name_len) - HEADER.size - name_len - 8 - 8  # its digest, the stamp
    assert meta_fits(name_len, room) and not meta_fits(name_len, room + 1)
    # a key long enough that the page beside the name holds less than kvcore's limit
    long_key = "k" * (header_size(name_len) - HEADER.size - name_len - 100)
    long_len = len(store.request("x", [long_key]).object_names[0][0].encode())
    assert not meta_fits(long_len, kvcore.MAX_BLOCK_META_BYTES)
    assert _write(store, [long_key], [b"m" * kvcore.MAX_BLOCK_META_BYTES]) == 1
    assert _describe(store, [long_key]) == [None]
    assert read_verified(store, [long_key]) == 1  # stored, without its metadata
    store.close()


def test_a_reader_that_predates_metadata_sees_the_same_object(tmp_path) -> None:
    """Objects without metadata are byte for byte the format before it; with it, the fields a
    reader of that format parses (magic, version, flags aside, name, length, checksum) are
    unchanged and the payload sits where it did."""
    store = open_store(str(tmp_path / "s"))
    assert _write(store, ["plain"], None) == 1
    assert _write(store, ["meta"], [META[0]]) == 1
    for key, has_meta in (("plain", False), ("meta", True)):
        with open(object_path(store, key), "rb") as f:
            raw = f.read()
        magic, version, flags, name_len, length, _digest, meta_len = HEADER.unpack_from(raw)
        assert (magic, version) == (b"KVCF", 1)
        assert (flags, meta_len > 0) == ((1, True) if has_meta else (0, False))
        assert length == store.context.layout.part_bytes("k")
        assert len(raw) == header_size(name_len) + length
        header = Header.parse(raw)
        assert header is not None and header.length == length
    assert _describe(store, ["plain", "meta"]) == [None, META[0]]
    store.close()


def test_the_door_refuses_metadata_it_cannot_keep(tmp_path) -> None:
    store = open_store(str(tmp_path / "s"))
    with pytest.raises(ValueError, match=r"block_meta\[1\] is 2049 bytes"):
        store.request("w", ["a", "b"], block_meta=[b"", b"x" * 2049])
    with pytest.raises(ValueError, match="block_meta must hold one bytes per block"):
        store.request("w", ["a", "b"], block_meta=[b""])
    with pytest.raises(ValueError, match=r"block_meta\[0\] is str"):
        store.request("w", ["a"], block_meta=["text"])  # type: ignore[list-item]
    store.close()
