"""Crash safety (SIGKILL during batch writes) and several processes sharing one root."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kv_file_testutil import object_files, open_store, read_verified, write

CHILD = str(Path(__file__).with_name("kv_file_child.py"))
ROUNDS = 24
BLOCKS = 160


def _start(*args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, CHILD, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigkill_during_batch_writes_leaves_only_verified_objects(tmp_path) -> None:
    root = str(tmp_path / "s")
    rng = random.Random(1234)
    killed_mid_write = 0
    for r in range(ROUNDS):
        child = _start("crash", root, f"r{r}", BLOCKS)
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        time.sleep(rng.uniform(0.0, 0.15))
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        if child.returncode == -signal.SIGKILL:
            killed_mid_write += 1
    assert killed_mid_write >= ROUNDS // 2, "most kills should land while writing"
    # a temp file of a dead writer may be left: opening removes it, and it is never an object
    store = open_store(root)
    assert not [p for p in Path(root).rglob("*.tmp")], "stale temp files survived the open"
    readable = 0
    for r in range(ROUNDS):
        for i in range(BLOCKS):
            readable += read_verified(store, [f"r{r}-{i}"])  # asserts the exact bytes
    stats = store.stats()
    assert stats.get("backend_corrupt_removed", 0) == 0
    assert readable > 0
    assert stats["backend_objects"] == len(object_files(root))
    # and the store still works
    assert write(store, ["after-0", "after-1"]) == 2
    assert read_verified(store, ["after-0", "after-1"]) == 2
    store.close()


def _run_workers(root: str, workers: int, capacity: int = 0) -> list[dict]:
    procs = [_start("share", root, w, workers, capacity) for w in range(workers)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_four_processes_on_the_same_keys(tmp_path) -> None:
    root = str(tmp_path / "s")
    results = _run_workers(root, 4)
    for res in results:
        assert res["shared_read"] == 6 * 16, res  # every round read every shared block
        assert res["others_read"] == 3 * 8, res  # and every other worker's writes, unscanned
    store = open_store(root)
    assert read_verified(store, [f"own-{w}-{i}" for w in range(4) for i in range(8)]) == 32
    store.close()


def test_four_processes_evicting_never_tear_reads(tmp_path) -> None:
    # a capacity of a few blocks: the workers evict each other's files while reading them;
    # reads may miss, but every block that reads is exact (asserted in the child)
    _run_workers(str(tmp_path / "s"), 4, capacity=6 * 2 * 70_000)


def test_other_processes_writes_are_seen_by_query_and_rescan(tmp_path) -> None:
    root = str(tmp_path / "s")
    a, b = open_store(root), open_store(root)
    assert write(a, ["x", "y"]) == 2
    assert b.query(b.request("q", ["x", "y"])) == 2  # found on disk, adopted
    assert write(a, ["z"]) == 1
    b.plugin.rescan()
    assert b.stats()["backend_objects"] == 6
    # an eviction in one process is noticed by the other: a read miss, then forgotten
    for path in object_files(root):
        os.unlink(path)
    assert read_verified(b, ["x"]) == 0
    b.plugin.rescan()
    assert b.stats()["backend_objects"] == 0
    a.close()
    b.close()
