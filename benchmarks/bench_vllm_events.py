"""What it costs a vLLM engine to announce a shared store it attaches to: KVCoreConnector's
store follower (``kvcore_vllm.events.StoreFollower``) over a store that another engine filled
with ``--blocks`` blocks (default 100,000), each carrying its descriptor: a kv_file root
(``--backend file``) or a Mooncake cluster (``--backend mooncake``: a real ``mooncake_master``
on 127.0.0.1 and a storage node holding the objects).

Attaching is: list the store (``Backend.names``), group the objects into whole blocks (every
part of every slice), read each block's descriptor from its first object's header
(``Backend.describe``: one open and one 4 KiB read per block), check it against the block's
key, and build vLLM's ``BlockStored`` events (published here into a counting publisher). It
runs in rounds of at most ``DESCRIBED_PER_ROUND`` blocks (the engine publishes the store's
other changes between them); this benchmark runs them back to back.

Baseline, the limit of reading what the blocks say, in the same repetition: for kv_file, the
same blocks' first objects opened and their first 4 KiB read with plain system calls
(``os.open``/``os.pread``/``os.close``) from one thread; for Mooncake, the master's key
listing fetched once and every block's metadata companion read with the raw client's
``get_batch`` in the same chunks. Figures: seconds to announce the store (listing and
grouping, descriptors and events), blocks announced per second, and the ratio of the raw
reads' time to the follower's (1.0: the follower costs no more than the reads).

The store lives on ``--dir`` (default /dev/shm: the page cache holds every header, as it does
for a store an engine just wrote; a cold disk adds one random 4 KiB read per block).
Runs in the vLLM adapter's venv (re-executes there).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import Report, emit, python_with_vllm

python_with_vllm("bench_vllm_events")

import numpy as np  # noqa: E402
from kvcore_vllm.descriptors import BlockDescriber, BlockFacts, encode  # noqa: E402
from kvcore_vllm.events import SchedulerEvents, StoreFollower  # noqa: E402
from kvcore_vllm.keys import RequestKeys  # noqa: E402

import kvcore  # noqa: E402

BLOCK_SIZE = 16
LAYOUT = kvcore.CacheLayout(num_layers=1, num_heads=1, block_size=BLOCK_SIZE, head_dim=8)
WRITE_BATCH = 4096


class _Prefix:
    """What RequestKeys reads of a vLLM request: its block hashes."""

    def __init__(self, hashes: list[bytes]) -> None:
        self.request_id = "bench"
        self.block_hashes = hashes


class CountingPublisher:
    def __init__(self) -> None:
        self.events = 0

    def publish(self, batch: object) -> None:
        self.events += len(batch.events)  # type: ignore[attr-defined]


def fill(
    store: tuple[str, dict], blocks: int, keys: RequestKeys, describer: BlockDescriber
) -> list[str]:
    """A store of ``blocks`` blocks, as an engine's connector writes them; their keys."""
    rng = np.random.default_rng(3)
    hashes = [rng.bytes(32) for _ in range(blocks)]
    all_keys = keys.keys(_Prefix(hashes), 0, blocks)
    backend = kvcore.open_backend(
        store[0], store[1], context=kvcore.BackendContext(layout=LAYOUT, namespace="bench")
    )
    payload = np.zeros((WRITE_BATCH, LAYOUT.part_bytes("k")), dtype=np.uint8)
    try:
        parent = None
        for lo in range(0, blocks, WRITE_BATCH):
            batch = all_keys[lo : lo + WRITE_BATCH]
            metas = []
            for i, key in enumerate(batch):
                block_hash = describer.block_hash(key)
                tokens = list(range((lo + i) * BLOCK_SIZE, (lo + i + 1) * BLOCK_SIZE))
                facts = BlockFacts(block_hash, parent, tokens, BLOCK_SIZE, None, None, None)
                metas.append(encode(facts))
                parent = block_hash
            base = payload.ctypes.data
            size = payload.shape[1]
            host = kvcore.HostBuffers(
                ptrs=tuple((base + i * size, base + i * size) for i in range(len(batch))),
                nbytes=(size, size),
            )
            request = backend.request("fill", batch, host=host, block_meta=metas, timeout_s=600)
            assert backend.write(request) == len(batch)
    finally:
        backend.close()
    return list(all_keys)


def announce_s(
    store: tuple[str, dict], keys: RequestKeys, describer: BlockDescriber, blocks: int
) -> float:
    """Seconds for a fresh follower to announce the store, and a check that it did."""
    backend = kvcore.open_backend(
        store[0],
        store[1],
        context=kvcore.BackendContext(layout=LAYOUT, namespace="bench", role="lookup"),
    )
    publisher = CountingPublisher()
    events = SchedulerEvents(1, describer, max_known_blocks=blocks)
    follower = StoreFollower(
        events, backend, [(0, 1)], LAYOUT.parts, lambda: publisher, interval_s=3600.0
    )
    try:
        t0 = time.perf_counter()
        follower.attach()
        while events.waiting():
            follower.round()
        follower.round()
        elapsed = time.perf_counter() - t0
    finally:
        follower.close()
        backend.close()
    assert publisher.events == blocks and events.unmapped == 0, (publisher.events, blocks)
    return elapsed


def raw_header_reads_s(paths: list[str]) -> float:
    """The limit: as many objects' headers as there are blocks, read with plain system
    calls (one object per block: which one does not change the cost)."""
    t0 = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.pread(fd, 4096, 0)
        os.close(fd)
    return time.perf_counter() - t0


def raw_mooncake_reads_s(config: dict, block_keys: list[str]) -> float:
    """The limit on Mooncake: the master's listing once, and each block's metadata companion
    (its first object's) read with the raw client, in the chunks kv_mooncake reads them."""
    from kv_mooncake.block_meta import meta_key
    from kv_mooncake.connect import http_get
    from kv_mooncake.store_keys import store_key
    from mooncake.store import MooncakeDistributedStore

    from kvcore.keys import object_name

    companions = [
        meta_key(store_key(object_name(k, LAYOUT.parts[0], namespace="bench", rank=0,
                                       world_size=1), "bench"))
        for k in block_keys
    ]  # fmt: skip
    client = MooncakeDistributedStore()
    master = config["master_server_address"]
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
    try:
        t0 = time.perf_counter()
        http_get(f"http://127.0.0.1:{config['master_metrics_port']}/get_all_keys", 60)
        got = 0
        for lo in range(0, len(companions), 512):
            got += sum(1 for blob in client.get_batch(companions[lo : lo + 512]) if blob)
        elapsed = time.perf_counter() - t0
    finally:
        client.close()
    assert got == len(companions), (got, len(companions))
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--backend", choices=("file", "mooncake"), default="file")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    keys = RequestKeys(kvcore.KeyScope(model="bench", namespace="bench"), BLOCK_SIZE, BLOCK_SIZE)
    describer = BlockDescriber(BLOCK_SIZE, keys)
    report = Report()
    with contextlib.ExitStack() as stack:
        if args.backend == "file":
            root = tempfile.mkdtemp(prefix="kvcore-bench-attach-", dir=args.dir)
            stack.callback(shutil.rmtree, root, ignore_errors=True)
            store = ("file", {"root": root, "capacity_bytes": 64 * args.blocks * 8192})
        else:
            from kv_mooncake.testing import MooncakeCluster, isolate_loopback

            isolate_loopback()  # Mooncake clients listen on the wildcard address
            # per block: 2 objects of 256 B, a digest, 2 companions (Mooncake rounds each up)
            cluster = stack.enter_context(MooncakeCluster(storage_bytes=args.blocks * 16384))
            store = ("mooncake", cluster.config(rpc_timeout_ms=20_000))
        t0 = time.perf_counter()
        block_keys = fill(store, args.blocks, keys, describer)
        fill_s = time.perf_counter() - t0
        paths = []
        if args.backend == "file":
            paths = sorted(str(p) for p in Path(store[1]["root"]).rglob("*.kv"))[: args.blocks]
        follower_s, raw_s = [], []
        for rep in range(args.reps):
            order = ("follower", "raw") if rep % 2 == 0 else ("raw", "follower")
            for contender in order:
                if contender == "follower":
                    follower_s.append(announce_s(store, keys, describer, args.blocks))
                elif args.backend == "file":
                    raw_s.append(raw_header_reads_s(paths))
                else:
                    raw_s.append(raw_mooncake_reads_s(store[1], block_keys))
    report.figure("attach_announce_s", follower_s, "s")
    report.figure("attach_blocks_per_s", [args.blocks / s for s in follower_s], "blocks/s")
    report.figure("raw_header_reads_s", raw_s, "s")
    report.ratio("raw_header_reads_vs_announce", raw_s, follower_s)
    report.notes["setup"] = {
        "backend": args.backend,
        "blocks": args.blocks,
        "objects": args.blocks * len(LAYOUT.parts),
        "fill_s": round(fill_s, 1),
        "store_dir": (args.dir or tempfile.gettempdir()) if args.backend == "file" else None,
    }
    emit(report.as_dict(), args.json)


if __name__ == "__main__":
    main()
