"""Several processes on one root: one capacity for the directory, whoever writes, and events that
describe the store exactly, evictions by other processes included.

Four writer processes write new blocks of their own and blocks of a pool they all share into a
store smaller than what they write, for a minute (three for the events), while this process
samples the directory every 50 ms.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kv_file.objio import read_name
from kv_file_testutil import LAYOUT, object_files, open_store, read_verified

import kvcore
from kvcore.events import StoreIndex

CHILD = str(Path(__file__).with_name("kv_file_child.py"))
WRITERS = 4
CAPACITY = 12 << 20  # ~90 blocks of 136 KiB: far below what four writers write in a minute


def _start_writers(root: str, seconds: float) -> list[subprocess.Popen]:
    procs = []
    for w in range(WRITERS):
        out = f"{root}.writer{w}.jsonl"
        p = subprocess.Popen(
            [sys.executable, CHILD, "churn", root, str(w), str(seconds), str(CAPACITY), out],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        p.log_path = out  # type: ignore[attr-defined]
        procs.append(p)
    for p in procs:
        line = p.stdout.readline().strip()
        assert line == "ready", p.stderr.read()[-3000:]
    return procs


def _finish(p: subprocess.Popen, timeout: float) -> tuple[list[str], dict | None]:
    """Acknowledged keys and final stats of a writer (None: it was killed)."""
    _, err = p.communicate(timeout=timeout)
    if p.returncode != -signal.SIGKILL:
        assert p.returncode == 0, err[-3000:]
    acked: list[str] = []
    stats = None
    with open(p.log_path) as f:  # type: ignore[attr-defined]
        for line in f:
            if not line.endswith("\n"):
                break  # the last line of a killed writer may be cut
            item = json.loads(line)
            if isinstance(item, dict):
                stats = item["stats"]
            else:
                acked += item
    return acked, stats


class DiskSampler:
    """Bytes under the store's directory every 50 ms: object and temp files (what the capacity
    bounds), and everything (the journal and its ledger too)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.peak_data = self.peak_total = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> tuple[int, int]:
        data = other = 0
        for entry in os.scandir(self.directory):
            if entry.is_dir(follow_symlinks=False):
                try:
                    files = list(os.scandir(entry.path))
                except FileNotFoundError:
                    continue
                for f in files:
                    try:
                        data += f.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue
            else:
                try:
                    other += entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
        return data, data + other

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            data, total = self._sample()
            self.peak_data = max(self.peak_data, data)
            self.peak_total = max(self.peak_total, total)
            self.samples += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_four_writers_hold_one_capacity_and_a_killed_one_breaks_nothing(tmp_path) -> None:
    root = str(tmp_path / "s")
    open_store(root, capacity_bytes=CAPACITY).close()  # the directory, for the sampler
    sampler = DiskSampler(os.path.join(root, "default"))
    procs = _start_writers(root, seconds=60)
    time.sleep(20)
    procs[0].send_signal(signal.SIGKILL)  # mid-run: its reservation and temp files are left
    results = [_finish(p, timeout=180) for p in procs]
    sampler.stop()
    assert procs[0].returncode == -signal.SIGKILL
    print(
        f"shared root: {sampler.samples} samples, peak data {sampler.peak_data / CAPACITY:.3f}x "
        f"and with journal/ledger {sampler.peak_total / CAPACITY:.3f}x the capacity"
    )
    assert sampler.samples > 600
    bound = 1.05 * CAPACITY
    assert sampler.peak_data <= bound, f"peak {sampler.peak_data / CAPACITY:.3f} x the capacity"
    assert sampler.peak_total <= bound, (
        f"with the journal and ledger: peak {sampler.peak_total / CAPACITY:.3f} x the capacity"
    )
    for _, stats in results[1:]:  # survivors: misses when another process evicted, no errors
        assert stats is not None
        assert stats.get("backend_io_errors", 0) == 0 and stats.get("backend_write_errors", 0) == 0
        assert stats.get("backend_corrupt_removed", 0) == 0
        assert stats["backend_evictions"] > 0
    acked = {k for keys, _ in results for k in keys}
    assert len(acked) * LAYOUT.block_bytes > 10 * CAPACITY  # far more than the store holds
    # a restart: the dead writer's reservation and temp files are gone, the files are counted
    store = open_store(root, capacity_bytes=CAPACITY)
    stats = store.stats()
    used, own = stats["backend_bytes_used"], stats["backend_own_files_bytes"]
    on_disk = sum(os.path.getsize(p) for p in object_files(root))
    assert used == on_disk and used + own <= CAPACITY
    assert not list(Path(root).rglob("*.tmp"))
    present = [k for k in sorted(acked) if store.query(store.request("q", [k])) == 1]
    assert present, "nothing acknowledged survived"
    assert read_verified(store, present) == len(present)  # every byte exact
    store.close()


def test_events_describe_the_store_exactly_under_churn(tmp_path) -> None:
    """An index built only from one process's events equals what the store holds at the end,
    object by object: 0 stale, 0 missing, evictions by the other processes included."""
    root = str(tmp_path / "s")
    layout_ctx = {"layout": LAYOUT, "namespace": "default"}
    observer = kvcore.open_backend(
        "file", {"root": root, "capacity_bytes": CAPACITY}, context=layout_ctx, strict=True
    )
    index = StoreIndex()
    kinds: dict[str, int] = {}
    with observer.events.subscribe() as sub:
        procs = _start_writers(root, seconds=180)
        while any(p.poll() is None for p in procs):
            for event in sub.drain():
                index.apply(event)
                kinds[f"{event.kind}/{event.origin}"] = (
                    kinds.get(f"{event.kind}/{event.origin}", 0) + 1
                )
            time.sleep(0.2)
        results = [_finish(p, timeout=60) for p in procs]
        observer.plugin._catalog.sync()
        index.apply_all(sub.drain())
    print(f"events under churn: {kinds}, {len(index)} objects at the end")
    assert index.resyncs == 0
    assert kinds.get("evicted/peer", 0) > 1000, kinds  # other processes' evictions, seen
    # the truth, object by object: the name in each file's header
    on_disk = set()
    for path in object_files(root):
        raw = read_name(path)
        if raw is not None:
            on_disk.add(raw.decode())
    stale = set(index.objects) - on_disk
    missing = on_disk - set(index.objects)
    assert not stale and not missing, (len(stale), len(missing), sorted(stale)[:3])
    # and block by block, as a query sees it
    acked = {k for keys, _ in results for k in keys}
    names = {k: observer.request("q", [k]).object_names[0] for k in acked}
    for key in acked:
        held = observer.query(observer.request("q", [key])) == 1
        told = all(n in index.objects for n in names[key])
        assert held == told, key
    observer.close()
