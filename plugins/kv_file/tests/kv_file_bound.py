"""Bytes on a file system of its own while writers fill a store: run by
``test_file_capacity_bound.py`` inside a private tmpfs (as a script, never imported by pytest).

``python kv_file_bound.py MOUNT CAPACITY PROCESSES THREADS SECONDS HIGH_WATERMARK MIN_BLOCKS``
starts PROCESSES writer processes of THREADS threads each, writing fresh blocks into one store
on MOUNT for SECONDS and, past them, until each process has written MIN_BLOCKS (the work the
test needs, however busy the machine: at most :data:`OVERTIME_S` more), and a sampler process
that reads ``statvfs(MOUNT)`` every millisecond; then prints one JSON line: the peak bytes in
use on MOUNT, the samples taken, the blocks written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: 4 KiB parts: objects of two file system blocks, where a per-file overhead shows most
LAYOUT_ARGS = {"num_layers": 1, "num_heads": 1, "block_size": 16, "head_dim": 128}
#: how long writers go on past SECONDS for their MIN_BLOCKS (a store that refuses every write
#: must not hold the test forever)
OVERTIME_S = 240.0


def used_bytes(mount: str) -> int:
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def sample(mount: str) -> None:
    """Until stdin closes: the peak of ``statvfs`` every millisecond."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    peak = samples = 0
    print("ready", flush=True)
    while not stop.is_set():
        peak = max(peak, used_bytes(mount))
        samples += 1
        time.sleep(0.001)
    print(json.dumps({"peak": peak, "samples": samples}), flush=True)


def fill(
    root: str, capacity: int, threads: int, seconds: float, high: float, min_blocks: int
) -> None:
    from kv_file_testutil import open_store, write

    from kvcore import CacheLayout

    store = open_store(
        root,
        CacheLayout(**LAYOUT_ARGS),
        capacity_bytes=capacity,
        high_watermark=high,
        low_watermark=min(high, 0.85),
    )
    print("ready", flush=True)
    sys.stdin.readline()
    written = [0] * threads
    end = time.monotonic() + seconds

    def going() -> bool:
        now = time.monotonic()
        return now < end or (sum(written) < min_blocks and now < end + OVERTIME_S)

    def writer(t: int) -> None:
        while going():
            written[t] += int(write(store, [uuid.uuid4().hex for _ in range(4)]))

    pool = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    refused = store.stats().get("backend_write_refused", 0)
    store.close()
    print(json.dumps({"written": sum(written), "refused": refused}), flush=True)


def main() -> None:
    mount, capacity, processes, threads, seconds, high, min_blocks = sys.argv[1:8]
    me = [sys.executable, os.path.abspath(__file__)]
    root = os.path.join(mount, "store")
    sampler = subprocess.Popen([*me, "--sample", mount], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert sampler.stdout is not None and sampler.stdout.readline().strip() == "ready"
    before = used_bytes(mount)
    writers = [
        subprocess.Popen(
            [*me, "--write", root, capacity, threads, seconds, high, min_blocks],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(int(processes))
    ]
    for w in writers:
        assert w.stdout is not None and w.stdout.readline().strip() == "ready"
    for w in writers:
        assert w.stdin is not None
        w.stdin.write("go\n")
        w.stdin.flush()
    results = [
        json.loads(w.communicate(timeout=float(seconds) + OVERTIME_S + 120)[0].splitlines()[-1])
        for w in writers
    ]
    assert all(w.returncode == 0 for w in writers)
    peak = json.loads(sampler.communicate(timeout=60)[0].strip().splitlines()[-1])
    print(json.dumps({
        "before": before,
        "peak": peak["peak"],
        "samples": peak["samples"],
        "after": used_bytes(mount),
        "written": sum(r["written"] for r in results),
        "refused": sum(r["refused"] for r in results),
    }))  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1] == "--sample":
        sample(sys.argv[2])
    elif sys.argv[1] == "--write":
        root, capacity, threads, seconds, high, min_blocks = sys.argv[2:8]
        fill(root, int(capacity), int(threads), float(seconds), float(high), int(min_blocks))
    else:
        main()
