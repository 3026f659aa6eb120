"""A shortfall the backend knows is a failure (a full disk, an I/O error, a corrupt object)
reaches the engine as ``Outcome.failure``; absence and a full store are plain misses."""

from __future__ import annotations

import errno
import logging
import os

from kv_file.objfile import PAGE
from kv_file_testutil import (
    LAYOUT,
    disk_bytes,
    fail_object_io,
    object_path,
    open_store,
    query,
    read,
    write,
)

import kvcore
from kvcore.testing import small_layout


def _raise(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail


def test_a_full_disk_is_a_reported_failure_logged_once(
    tmp_path, monkeypatch, caplog, io_path
) -> None:
    store = open_store(str(tmp_path / "s"))
    assert write(store, ["a"]) == 1
    fail_object_io(monkeypatch, "write", errno.ENOSPC)
    with caplog.at_level(logging.DEBUG, logger="kvcore.file"):
        for _ in range(3):
            got = write(store, ["a", "b"])
            assert got == 1
            assert "No space left on device" in (got.failure or "")
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and r.name == "kvcore.file"
    ]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert store.stats()["backend_write_errors"] == 3
    assert store.stats()["backend_bytes_used"] == disk_bytes(str(tmp_path / "s")), (
        "a failed write gives its reservation back"
    )
    monkeypatch.undo()
    assert write(store, ["a", "b"]) == 2
    store.close()


def test_an_io_error_on_read_is_a_reported_failure(tmp_path, monkeypatch, io_path) -> None:
    store = open_store(str(tmp_path / "s"))
    assert write(store, ["a"]) == 1
    fail_object_io(monkeypatch, "read", errno.EIO)
    done, _ = read(store, ["a"])
    assert done == 0
    assert "Input/output error" in (done.failure or "")
    store.close()


def test_a_corrupt_object_is_a_reported_failure(tmp_path) -> None:
    store = open_store(str(tmp_path / "s"))
    assert write(store, ["a", "b"]) == 2
    path = object_path(store, "b", 1)
    with open(path, "r+b") as f:
        f.seek(PAGE + 10)
        f.write(b"\xff\xfe")
    done, _ = read(store, ["a", "b"])
    assert done == 1
    assert "corrupt" in (done.failure or "")
    store.close()


def test_absence_and_a_full_store_are_plain_misses(tmp_path) -> None:
    store = open_store(str(tmp_path / "s"), capacity_bytes=LAYOUT.part_bytes("k") // 2)
    assert (got := write(store, ["big"])) == 0 and got.failure is None
    assert (got := query(store, ["big"])) == 0 and got.failure is None
    assert (got := read(store, ["big"])[0]) == 0 and got.failure is None
    store.close()


def test_a_store_without_a_layout_answers_queries(tmp_path) -> None:
    root = str(tmp_path / "s")
    with_layout = open_store(root, small_layout())
    assert write(with_layout, ["a"]) == 1
    bare = kvcore.open_backend("file", {"root": root, "rescan_interval_s": 0}, strict=True)
    assert bare.query(bare.request("q", ["a", "b"])) == 1
    bare.close()
    with_layout.close()


def test_a_read_into_memory_it_cannot_write_is_a_failure_never_corruption(tmp_path) -> None:
    """An engine's bad pointer (here: the last page of a V buffer made read-only): the kernel
    reads up to it and stops. That short read was taken for a torn file, reported as checksum
    corruption, and the good object removed."""
    import ctypes
    import mmap

    from kv_file_testutil import read_verified

    store = open_store(str(tmp_path / "s"))
    assert write(store, ["a"]) == 1
    part = LAYOUT.part_bytes("k")
    region = mmap.mmap(-1, 2 * part)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    assert libc.mprotect(ctypes.c_void_p(base + 2 * part - page), page, mmap.PROT_READ) == 0
    host = kvcore.HostBuffers(ptrs=((base, base + part),), nbytes=(part, part))
    got = store.read(store.request("bad-pointer", ["a"], host=host))
    assert got == 0
    assert "Bad address" in (got.failure or ""), got.failure
    assert got.kind != "corrupt" and "corrupt" not in (got.failure or "").lower()
    stats = store.stats()
    assert stats.get("backend_corrupt_objects", 0) == 0, stats
    assert query(store, ["a"]) == 1, "the good object was removed"
    assert read_verified(store, ["a"]) == 1
    store.close()
