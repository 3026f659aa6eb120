"""The index never trusts a name alone: a file that is not the object its name promises (a
short object, a symlink, a directory, a FIFO, a file that vanished) is never counted by a
query after it has been seen, never makes a rewrite be skipped, and does not survive restarts.
"""

from __future__ import annotations

import os

import kv_file_testutil as kt
import pytest
from kv_file_testutil import object_files, object_path, open_store, query, read_verified, write

from kvcore import HostBuffers

#: every test here runs on both I/O paths: native (kvcore.fileio) and Python
pytestmark = pytest.mark.usefixtures("io_path")


def _write_short(store, keys: list[str]) -> int:
    """Write through the hook itself with buffers half the part size: a buggy caller that
    no door check in the core stopped."""
    full = kt.host_for(kt.payload(store, keys), len(keys))
    short = HostBuffers(ptrs=full.ptrs, nbytes=tuple(n // 2 for n in full.nbytes))
    return store.plugin.kvcore_write(request=store.request("short", keys, host=short))


@pytest.mark.parametrize("when", ["same_process", "after_restart"])
def test_a_short_object_is_never_counted_and_a_rewrite_replaces_it(tmp_path, when: str) -> None:
    root = str(tmp_path / "s")
    store = open_store(root)
    assert _write_short(store, ["k"]) == 1
    if when == "after_restart":
        store.close()
        store = open_store(root)
    assert query(store, ["k"]) == 0, "a short object must not be counted"
    assert write(store, ["k"]) == 1
    assert read_verified(store, ["k"]) == 1
    store.close()
    reopened = open_store(root)
    assert query(reopened, ["k"]) == 1
    assert read_verified(reopened, ["k"]) == 1
    reopened.close()


def _replace(path: str, kind: str, tmp_path) -> str | None:
    """Put a ``kind`` where the object file was; returns a symlink's target, if any."""
    os.unlink(path)
    if kind == "symlink":
        target = str(tmp_path / "target")
        with open(target, "wb") as f:
            f.write(b"not yours")
        os.symlink(target, path)
        return target
    if kind == "directory":
        os.mkdir(path)
        with open(os.path.join(path, "inside"), "wb") as f:
            f.write(b"x")
    else:
        os.mkfifo(path)
    return None


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_a_non_file_in_place_of_an_indexed_object_heals(tmp_path, kind: str) -> None:
    store = open_store(str(tmp_path / "s"))
    assert write(store, ["a", "b"]) == 2
    path = object_path(store, "b")
    target = _replace(path, kind, tmp_path)
    assert kt.read(store, ["a", "b"])[0] == 1  # never hangs on a FIFO, never follows a link
    assert not os.path.lexists(path), f"the {kind} is removed"
    if target is not None:
        with open(target, "rb") as f:
            assert f.read() == b"not yours", "a symlink's target is left alone"
    assert query(store, ["a", "b"]) == 1
    assert write(store, ["a", "b"]) == 2
    assert read_verified(store, ["a", "b"]) == 2
    assert store.stats()["backend_foreign_removed"] == 1
    store.close()


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_a_non_file_found_at_open_is_never_counted(tmp_path, kind: str) -> None:
    root = str(tmp_path / "s")
    store = open_store(root)
    assert write(store, ["a", "b"]) == 2
    path = object_path(store, "b")
    store.close()  # the name snapshot still names b's file
    _replace(path, kind, tmp_path)
    reopened = open_store(root)
    assert query(reopened, ["a", "b"]) == 1
    assert write(reopened, ["a", "b"]) == 2
    assert read_verified(reopened, ["a", "b"]) == 2
    assert len(object_files(root)) == 4
    reopened.close()


def test_a_rewrite_is_not_skipped_when_the_file_is_gone(tmp_path) -> None:
    # another process evicted or removed it; this one's index still names it
    store = open_store(str(tmp_path / "s"))
    assert write(store, ["a", "b"]) == 2
    for path in kt.object_paths(store, "b"):
        os.unlink(path)
    assert write(store, ["a", "b"]) == 2
    assert read_verified(store, ["a", "b"]) == 2
    store.close()


def test_a_directory_where_a_new_object_goes_fails_that_write_once(tmp_path) -> None:
    """A write does not look before it writes an object no record tells of: a directory put
    in its place meanwhile fails that write (reported), is removed, and the next write lands."""
    store = open_store(str(tmp_path / "s"))
    path = object_path(store, "n")
    os.makedirs(path)
    with open(os.path.join(path, "inside"), "wb") as f:
        f.write(b"x")
    got = write(store, ["n"])
    assert got == 0 and "Is a directory" in (got.failure or ""), got
    assert not os.path.lexists(path), "the directory is removed"
    assert write(store, ["n"]) == 1
    assert read_verified(store, ["n"]) == 1
    store.close()
