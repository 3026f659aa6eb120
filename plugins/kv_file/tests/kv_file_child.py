"""A child process for the crash and sharing tests (run as a script, never imported by pytest)."""

from __future__ import annotations

import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kv_file_testutil import open_store, read_verified, write


def crash(root: str, tag: str, blocks: int) -> None:
    """Write ``blocks`` blocks in batches of 8 until killed (the parent SIGKILLs us)."""
    store = open_store(root)
    print("ready", flush=True)
    for start in range(0, blocks, 8):
        write(store, [f"{tag}-{i}" for i in range(start, start + 8)])
    store.close()


def share(root: str, worker: int, workers: int, capacity: int) -> None:
    """Hammer the same keys as the other workers; then read what each of them wrote."""
    cfg = {"capacity_bytes": capacity} if capacity else {}
    store = open_store(root, **cfg)
    shared = [f"shared-{i}" for i in range(16)]
    own = [f"own-{worker}-{i}" for i in range(8)]
    stats = {"shared_read": 0, "others_read": 0}
    for _ in range(6):
        assert write(store, shared) in range(17)
        stats["shared_read"] += read_verified(store, shared)  # asserts no torn/mixed bytes
        assert write(store, own) in range(9)
    open(os.path.join(root, f"done-{worker}"), "w").close()
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(root, f"done-{w}")) for w in range(workers)):
        assert time.monotonic() < deadline, "the other workers never finished"
        time.sleep(0.01)
    for w in range(workers):
        if w != worker:
            stats["others_read"] += read_verified(store, [f"own-{w}-{i}" for i in range(8)])
    store.close()
    print(json.dumps(stats), flush=True)


def remove(root: str, keys: list[str]) -> None:
    """Remove blocks from a store another process has open, and say how many were removed."""
    store = open_store(root)
    removed = store.remove(store.request("child-remove", keys))
    store.close()
    print(json.dumps({"removed": int(removed)}), flush=True)


def churn(root: str, worker: int, seconds: float, capacity: int, out: str) -> None:
    """Write for ``seconds``: batches of new blocks of this worker's and blocks of a pool all
    workers share, into a store smaller than what they write; now and then read back blocks
    written before (asserting exact bytes when found). Appends each batch's acknowledged keys
    to ``out`` as a JSON line as it goes (the parent may SIGKILL us), then this process's
    stats."""
    store = open_store(root, capacity_bytes=capacity, rescan_interval_s=2.0)
    rng = random.Random(worker)
    shared = [f"shared-{i}" for i in range(48)]
    acked: list[str] = []
    log = open(out, "a", buffering=1)  # noqa: SIM115 (line-buffered: a SIGKILL keeps lines)
    print("ready", flush=True)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        batch = [f"own-{worker}-{n + i}" for i in range(3)] + rng.sample(shared, 3)
        rng.shuffle(batch)
        n += 3
        done = int(write(store, batch))
        acked += batch[:done]
        log.write(json.dumps(batch[:done]) + "\n")
        if acked and rng.random() < 0.3:
            read_verified(store, rng.sample(acked, min(4, len(acked))))  # exact, or a miss
    stats = store.stats()
    store.close()
    log.write(json.dumps({"stats": stats}) + "\n")
    log.close()


def tenant_write(root: str, config: str, tenant: str, keys: list[str]) -> None:
    """Write ``keys`` as ``tenant`` in batches of 8 into a store opened with ``config`` (JSON),
    then say how many blocks were acknowledged."""
    store = open_store(root, **json.loads(config))
    acked = 0
    for start in range(0, len(keys), 8):
        acked += int(write(store, keys[start : start + 8], tenant=tenant))
    store.close()
    print(json.dumps({"acked": acked}), flush=True)


def clear_and_die(root: str, config: str, tenant: str) -> None:
    """Start clearing ``tenant`` and SIGKILL this process once the first few of its objects
    are removed (and recorded): a crash mid-clear."""
    import signal

    from kv_file import removal

    removal._CLEAR_BATCH = 4
    recorded = removal.removed_durably

    def record_then_die(files, digests):  # type: ignore[no-untyped-def]
        recorded(files, digests)
        if digests:
            os.kill(os.getpid(), signal.SIGKILL)

    removal.removed_durably = record_then_die
    store = open_store(root, **json.loads(config))
    store.clear(tenant=tenant)
    raise AssertionError("the clear ended without its SIGKILL")


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "clear_and_die":
        clear_and_die(args[0], args[1], args[2])
    elif mode == "tenant_write":
        tenant_write(args[0], args[1], args[2], json.loads(args[3]))
    elif mode == "crash":
        crash(args[0], args[1], int(args[2]))
    elif mode == "remove":
        remove(args[0], json.loads(args[1]))
    elif mode == "churn":
        churn(args[0], int(args[1]), float(args[2]), int(args[3]), args[4])
    else:
        share(args[0], int(args[1]), int(args[2]), int(args[3]))
