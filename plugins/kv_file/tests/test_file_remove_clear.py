"""remove and clear: crash-safe (nothing comes back after a restart or a rescan), seen at once
by every process sharing the root, and never touching another namespace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kv_file_testutil import object_files, open_store, query, read_verified, write

CHILD = str(Path(__file__).with_name("kv_file_child.py"))
KEYS = ["r0", "r1", "r2"]


def _remove(store, keys: list[str]) -> int:
    return store.remove(store.request("rm", keys))


def test_a_removed_block_stays_gone_after_a_restart_and_a_rescan(tmp_path) -> None:
    root = str(tmp_path / "s")
    store = open_store(root)
    assert write(store, KEYS) == 3
    assert _remove(store, ["r1"]) == 1
    assert query(store, KEYS) == 1
    store.close()  # saves the name snapshot
    reopened = open_store(root)
    assert query(reopened, KEYS) == 1
    reopened.plugin.rescan()
    assert query(reopened, KEYS) == 1
    assert query(reopened, ["r2"]) == 1
    assert write(reopened, KEYS) == 3
    assert read_verified(reopened, KEYS) == 3
    reopened.close()


def test_another_process_sees_a_removal_at_once(tmp_path) -> None:
    root = str(tmp_path / "s")
    store = open_store(root)
    assert write(store, KEYS) == 3
    assert query(store, KEYS) == 3  # every name is learned: nothing to look up on disk
    child = subprocess.run(
        [sys.executable, CHILD, "remove", root, json.dumps(KEYS[1:])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert json.loads(child.stdout.splitlines()[-1]) == {"removed": 2}
    assert query(store, KEYS) == 1, "no rescan needed: a removal is seen by the next query"
    assert write(store, KEYS) == 3, "removed blocks are written again, not skipped"
    assert read_verified(store, KEYS) == 3
    store.close()


def test_clear_removes_every_rank_of_the_namespace_for_good(tmp_path) -> None:
    root = str(tmp_path / "s")
    ranks = [open_store(root, rank=r, world_size=2) for r in (0, 1)]
    other = open_store(root, namespace="other")
    for store in (*ranks, other):
        assert write(store, KEYS) == 3
    assert ranks[0].clear() == 2 * 3 * 2  # objects: 2 ranks x 3 blocks x (k, v)
    for store in ranks:
        assert query(store, KEYS) == 0
    assert read_verified(other, KEYS) == 3
    for store in (*ranks, other):
        store.close()
    reopened = open_store(root, rank=1, world_size=2)
    assert query(reopened, KEYS) == 0
    reopened.plugin.rescan()
    assert query(reopened, KEYS) == 0
    assert reopened.stats()["backend_objects"] == 0
    reopened.close()
    assert len(object_files(root)) == 6  # the other namespace's


def test_clear_of_a_directory_shared_by_namespaces_removes_only_its_own(tmp_path) -> None:
    # a configured directory namespace overrides the engines': both engines write into it,
    # their object names still carry their own namespaces
    root = str(tmp_path / "s")
    a = open_store(root, namespace="shared", context_namespace="a")
    b = open_store(root, namespace="shared", context_namespace="b")
    assert write(a, KEYS) == 3
    assert write(b, KEYS) == 3
    assert query(b, KEYS) == 3
    assert a.clear() == 6
    assert query(a, KEYS) == 0
    assert read_verified(b, KEYS) == 3
    assert len(object_files(root)) == 6
    a.close()
    b.close()
