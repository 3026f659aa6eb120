"""What following a store's events costs: TransferManager write-backs on kv_file with a
subscriber attached (a router's index, :class:`kvcore.events.StoreIndex`, fed by a thread
draining it) against the same write-backs with nobody listening.

Two layouts: the typical one (28 layers x 8 heads x 64 tokens x 128 dim, bfloat16: 3.5 MiB
objects) and a small one (4 layers x 2 heads x 16 tokens x 64: 16 KiB objects), where the per
object work of an event (a journal record, a report, an index update) weighs the most. The
cache lives in host memory (the host-resident path: no staging copy, so nothing but the store
and the events is timed); the store is on ``--dir`` (default: /dev/shm, so the disk's
writeback does not swamp the difference). Each repetition runs, in rotated order: without a
subscriber (twice: A and A', the A/A control that measures the noise) and with one; every
write-back stores fresh keys. Ratios are per repetition: with / without, and A' / A.

Goal (issue 23): with >= 0.98x without, for the typical layout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
import uuid

import numpy as np
from bench_transfer import host_cache
from benchutil import Report, emit

import kvcore
from kvcore.events import StoreIndex
from kvcore.transfer import TransferManager

LAYOUTS = {
    "typical": dict(num_layers=28, num_heads=8, block_size=64, head_dim=128),
    "small": dict(num_layers=4, num_heads=2, block_size=16, head_dim=64),
}


class Follower:
    """A router's index, fed from a subscription by a thread of its own."""

    def __init__(self, backend: kvcore.Backend) -> None:
        self.index = StoreIndex()
        self._sub = backend.events.subscribe()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            event = self._sub.get(timeout=0.05)
            if event is not None:
                self.index.apply(event)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.index.apply_all(self._sub.drain())
        self._sub.close()


def write_back_s(tm: TransferManager, layout: kvcore.CacheLayout, blocks: int) -> float:
    tokens = np.random.default_rng().integers(0, 100_000, blocks * layout.block_size).tolist()
    keys = kvcore.block_hashes(
        tokens, layout.block_size, kvcore.KeyScope(namespace=uuid.uuid4().hex)
    )
    t0 = time.perf_counter()
    res = tm.write_back(
        {"task_id": "bench", "keys": keys, "device_block_ids": list(range(blocks))}
    ).result()
    elapsed = time.perf_counter() - t0
    assert res.outcome == "complete" and res.num_blocks == blocks, res
    return elapsed


def run_layout(name: str, args: argparse.Namespace, report: Report) -> None:
    blocks = args.blocks if name == "typical" else args.small_blocks
    layout = kvcore.CacheLayout(**LAYOUTS[name], num_blocks=blocks)
    cache = host_cache(layout, seed=1)
    root = tempfile.mkdtemp(prefix="kvcore-bench-events-", dir=args.dir)
    tm = TransferManager(
        {"layout": layout, "max_model_len": blocks * layout.block_size, "namespace": "bench"},
        cache,
        "file",
        {"root": root, "capacity_bytes": 64 * blocks * layout.block_bytes},
    )
    nbytes = blocks * layout.block_bytes
    samples: dict[str, list[float]] = {"without": [], "without_again": [], "with": []}
    objects = 0
    try:
        write_back_s(tm, layout, blocks)  # warm-up: files, threads
        for rep in range(args.reps):
            order = ["without", "with", "without_again"]
            order = order[rep % 3 :] + order[: rep % 3]
            for contender in order:
                follower = Follower(tm.backend) if contender == "with" else None
                samples[contender].append(nbytes / write_back_s(tm, layout, blocks) / 1e9)
                if follower is not None:
                    follower.close()
                    objects += len(follower.index)
            tm.backend.clear()
    finally:
        tm.close()
        shutil.rmtree(root, ignore_errors=True)
    assert objects >= args.reps * blocks * 2, "the follower missed stored objects"
    for contender, values in samples.items():
        report.figure(f"{name}_write_back_{contender}_subscriber_gbps", values, "GB/s")
    goal = ">= 0.98" if name == "typical" else None
    report.ratio(f"{name}_with_vs_without", samples["with"], samples["without"], goal=goal)
    report.ratio(f"{name}_aa_control", samples["without_again"], samples["without"])
    report.notes.setdefault("setup", {})[name] = {
        "blocks": blocks,
        "object_bytes": layout.part_bytes("k"),
        "bytes_per_write_back": nbytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=32, help="blocks per write-back (typical)")
    ap.add_argument("--small-blocks", type=int, default=2048, help="blocks (small layout)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--layouts", default="typical,small")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report = Report()
    for name in args.layouts.split(","):
        run_layout(name, args, report)
    report.notes["store_dir"] = args.dir or tempfile.gettempdir()
    emit(report.as_dict(), args.json)


if __name__ == "__main__":
    main()
