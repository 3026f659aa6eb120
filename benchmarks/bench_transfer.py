"""End-to-end write-back and read through the TransferManager on kv_file, beside its parts.

Same run, same bytes (64 blocks of the typical layout: 28 layers x 8 heads x 64 tokens x 128
dim bfloat16, K and V, 448 MiB):
- the manager: write_back (query, gather into staging, backend write) and read (query,
  backend read into staging, scatter into fresh device blocks);
- the backend alone: the same write and read from a staging buffer;
- the swap op alone: swap_cache_layout gather and scatter of the same blocks.
The manager's GB/s is compared with the slower of its two parts (goal >= 0.7x: the
pipeline must not lose much to its own bookkeeping). Reads are measured twice: warm (the
store's files in the page cache, so the backend read is itself a memory copy) and cold (the
files' pages dropped first, so it comes from the disk). Median of --repeats. One JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid

import numpy as np
import paddle

import kvcore
from kvcore import ops
from kvcore.cli.bench import TYPICAL, _staging
from kvcore.transfer import DeviceCache, TransferManager

GIB = 1024**3


def device_cache(layout: kvcore.CacheLayout, seed: int) -> DeviceCache:
    rng = np.random.default_rng(seed)
    tensors = {}
    for part in layout.parts:
        tensors[part] = []
        for _ in range(layout.total_layers):
            t = paddle.zeros(list(layout.kv_shape), dtype="bfloat16")
            np.from_dlpack(t.view(paddle.uint8))[...] = rng.integers(
                0, 256, (layout.num_blocks, layout.kv_layer_block_bytes), dtype=np.uint8
            ).reshape(np.from_dlpack(t.view(paddle.uint8)).shape)
            tensors[part].append(t)
    return DeviceCache(layout, tensors["k"], tensors["v"])


def drop_cached_pages(root: str) -> None:
    """Evict the store's files from the page cache, so the next read comes from the disk."""
    os.sync()  # dirty pages cannot be dropped
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".kv"):
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true", help="(the output is always JSON)")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fsync", default=None, help="kv_file fsync policy (default: its default)")
    ap.add_argument(
        "--pipeline-blocks", type=int, default=16, help="TransferConfig.pipeline_blocks"
    )
    ap.add_argument("--verbose", action="store_true", help="per-repetition stage timings on stderr")
    ap.add_argument("--root", default=None, help="directory for the store (default: a temp dir)")
    args = ap.parse_args()
    n = args.blocks
    layout = TYPICAL.model_copy(update={"num_blocks": 2 * n})
    root = tempfile.mkdtemp(prefix="kvcore-bench-", dir=args.root)
    fcfg = {"root": root, "capacity_bytes": 64 * GIB}
    if args.fsync:
        fcfg["fsync"] = args.fsync
    src = device_cache(layout, 1)
    dst = device_cache(layout.model_copy(), 2)
    nbytes = n * layout.block_bytes
    src_ids = list(range(n))
    dst_ids = list(range(n, 2 * n))
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "tm_write",
            "tm_read",
            "backend_write",
            "backend_read",
            "gather",
            "scatter",
            "parts_together_read",
            "tm_read_cold",
            "backend_read_cold",
        )
    }
    try:
        backend = kvcore.open_backend("file", fcfg, context={"layout": layout})
        tm_conf = {
            "layout": layout,
            "max_model_len": n * layout.block_size,
            "read_workers": 1,
            "write_workers": 1,
            "staging_buffers": 1,
            "default_timeout_s": 600,
        }
        tm = TransferManager(tm_conf, src, backend)
        staging, host = _staging(layout, n)
        for _ in range(args.repeats):
            tokens = rng.integers(0, 100_000, n * layout.block_size).tolist()
            keys = kvcore.block_hashes(
                tokens, layout.block_size, kvcore.KeyScope(namespace=uuid.uuid4().hex)
            )
            # the manager, end to end
            tm.restore_caches(src)
            w = tm.write_back({"task_id": "w", "keys": keys, "device_block_ids": src_ids}).result()
            assert w.num_blocks == n, w
            times["tm_write"].append(w.timings_s["total"])
            tm.restore_caches(dst)
            r = tm.read({"task_id": "r", "keys": keys, "device_block_ids": dst_ids}).result()
            assert r.num_blocks == n, r
            times["tm_read"].append(r.timings_s["total"])
            if args.verbose:
                print(
                    "read timings",
                    {k: round(v, 4) for k, v in r.timings_s.items()},
                    file=sys.stderr,
                )
            # the same read with the store's files out of the page cache: from the disk
            drop_cached_pages(root)
            tm.restore_caches(dst)
            r = tm.read({"task_id": "rc", "keys": keys, "device_block_ids": dst_ids}).result()
            assert r.num_blocks == n, r
            times["tm_read_cold"].append(r.timings_s["total"])
            # the swap op alone, same blocks
            for part, region in zip(layout.parts, staging, strict=True):
                t0 = time.perf_counter()
                ops.swap_cache_layout(
                    src.tensors[part], region, src.block_shape(part), src_ids, list(range(n)), 0, 0
                )
                times["gather"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ops.swap_cache_layout(
                    dst.tensors[part], region, dst.block_shape(part), dst_ids, list(range(n)), 0, 1
                )
                times["scatter"].append(time.perf_counter() - t0)
            # the backend alone, same bytes, fresh keys
            keys2 = kvcore.block_hashes(
                tokens, layout.block_size, kvcore.KeyScope(namespace=uuid.uuid4().hex)
            )
            t0 = time.perf_counter()
            assert backend.write(backend.request("bw", keys2, timeout_s=600, host=host)) == n
            t1 = time.perf_counter()
            assert backend.read(backend.request("br", keys2, timeout_s=600, host=host)) == n
            t2 = time.perf_counter()
            times["backend_write"].append(t1 - t0)
            times["backend_read"].append(t2 - t1)
            # both read stages at once, by hand, on separate buffers: what perfect overlap of
            # "backend read" and "scatter" could reach on this machine (they share its cores
            # and memory bus; on a GPU host the scatter is a DMA and does not)
            reader = threading.Thread(
                target=backend.read, args=(backend.request("bp", keys2, timeout_s=600, host=host),)
            )
            t0 = time.perf_counter()
            reader.start()
            for part, region in zip(layout.parts, staging, strict=True):
                ops.swap_cache_layout(
                    dst.tensors[part], region, dst.block_shape(part), dst_ids, list(range(n)), 0, 1
                )
            reader.join()
            times["parts_together_read"].append(time.perf_counter() - t0)
            # last: a cold read leaves the files out of the page cache (kv_file reads misses
            # with O_DIRECT)
            drop_cached_pages(root)
            t0 = time.perf_counter()
            assert backend.read(backend.request("brc", keys2, timeout_s=600, host=host)) == n
            times["backend_read_cold"].append(time.perf_counter() - t0)
        ok = all(
            np.array_equal(
                np.from_dlpack(a.view(paddle.uint8))[src_ids],
                np.from_dlpack(b.view(paddle.uint8))[dst_ids],
            )
            for part in layout.parts
            for a, b in zip(src.tensors[part], dst.tensors[part], strict=True)
        )
        tm.close()
        backend.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def gbps(key: str, parts: int = 1) -> float:
        return nbytes / GIB / (statistics.median(times[key]) * parts)

    figures = {
        "bytes_per_op": nbytes,
        "manager_write_gbps": gbps("tm_write"),
        "manager_read_gbps": gbps("tm_read"),
        "backend_write_gbps": gbps("backend_write"),
        "backend_read_gbps": gbps("backend_read"),
        "swap_gather_gbps": gbps("gather", len(layout.parts)),
        "swap_scatter_gbps": gbps("scatter", len(layout.parts)),
        "read_stages_overlapped_by_hand_gbps": gbps("parts_together_read"),
        "manager_read_cold_gbps": gbps("tm_read_cold"),
        "backend_read_cold_gbps": gbps("backend_read_cold"),
    }
    write_base = min(figures["backend_write_gbps"], figures["swap_gather_gbps"])
    read_base = min(figures["backend_read_gbps"], figures["swap_scatter_gbps"])
    ratios = {
        "write_vs_slower_part": figures["manager_write_gbps"] / write_base,
        "read_vs_slower_part": figures["manager_read_gbps"] / read_base,
        "read_vs_stages_overlapped_by_hand": figures["manager_read_gbps"]
        / figures["read_stages_overlapped_by_hand_gbps"],
        "read_cold_vs_slower_part": figures["manager_read_cold_gbps"]
        / min(figures["backend_read_cold_gbps"], figures["swap_scatter_gbps"]),
    }
    print(
        json.dumps(
            {
                "figures": {k: round(v, 3) for k, v in figures.items()},
                "ratios": {k: round(v, 3) for k, v in ratios.items()},
                "goals": {
                    "write_vs_slower_part": ">= 0.7",
                    "read_vs_slower_part": ">= 0.7",
                    "read_cold_vs_slower_part": ">= 0.7",
                },
                "bytes_verified": ok,
                "repeats": args.repeats,
                "machine": f"{platform.machine()} {platform.python_version()}",
            }
        )
    )


if __name__ == "__main__":
    main()
