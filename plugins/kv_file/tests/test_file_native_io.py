"""kv_file reads and writes objects through kvcore's native file I/O (``kvcore.fileio``): a
request's objects are one native batch that holds no GIL, with no Python call per object, and
only what a read cannot settle is read again by the per-object path (which is the fallback,
``KVCORE_NATIVE_IO=0``, and is tested beside it: ``io_path``). Both paths make the same files,
byte for byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kv_file import objio
from kv_file_testutil import object_path, open_store, read_verified, write

from kvcore import fileio

KEYS = [f"k{i}" for i in range(6)]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts native batches and their objects, and native calls per object; the Python
    path's vectored read fails the test if a good object reaches it."""
    counted = {"batches": 0, "objects": 0, "per_object": 0}
    real_batch, real_read = fileio.read_batch, fileio.read_file

    def batch(paths: list[str], *args: Any, **kwargs: Any) -> Any:
        counted["batches"] += 1
        counted["objects"] += len(paths)
        return real_batch(paths, *args, **kwargs)

    def per_object(*args: Any, **kwargs: Any) -> Any:
        counted["per_object"] += 1
        return real_read(*args, **kwargs)

    def python_path(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("a good object was read again by the Python path")

    monkeypatch.setattr(objio, "native_io", True)
    monkeypatch.setattr(fileio, "read_batch", batch)
    monkeypatch.setattr(fileio, "read_file", per_object)
    monkeypatch.setattr(objio, "_preadv_all", python_path)
    return counted


def test_a_read_is_one_native_batch_with_no_call_per_object(tmp_path, calls) -> None:
    store = open_store(str(tmp_path / "s"))
    assert write(store, KEYS) == len(KEYS)
    parts = len(store.context.layout.parts)
    assert read_verified(store, KEYS) == len(KEYS)
    assert calls == {"batches": 1, "objects": len(KEYS) * parts, "per_object": 0}
    store.close()


def test_a_corrupt_object_goes_to_the_python_path_which_removes_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(objio, "native_io", True)
    store = open_store(str(tmp_path / "s"))
    assert write(store, KEYS) == len(KEYS)
    path = object_path(store, KEYS[2])
    with open(path, "r+b") as f:  # one bit of the payload, past the header page
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0x10]))
    assert read_verified(store, KEYS) == 2  # the leading run ends at the corrupt object
    assert store.stats()["backend_corrupt_removed"] == 1
    store.close()


def test_native_and_python_writes_make_the_same_files(tmp_path, monkeypatch) -> None:
    files = {}
    for native in (True, False):
        monkeypatch.setattr(objio, "native_io", native)
        store = open_store(str(tmp_path / f"native-{native}"))
        assert write(store, KEYS) == len(KEYS)
        paths = [object_path(store, key) for key in KEYS]
        files[native] = [Path(p).read_bytes() for p in paths]
        monkeypatch.setattr(objio, "native_io", not native)  # each reads the other's way
        assert read_verified(store, KEYS) == len(KEYS)
        store.close()
    assert files[True] == files[False]
