"""Throughput of kvcore.ops swap ops against np.copyto of the same bytes, measured in one run.

Typical shape: 28 layers x [blocks, 8 heads, 64 tokens, 128 dim] bfloat16 (uint16 stand-in: the
ops move bytes), 64 blocks per call picked at random (no mergeable runs), default thread count. Reports the median of
--reps repetitions; `--json` prints one JSON object {"figures", "ratios", "goals"}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from benchutil import add_layout_args, emit

from kvcore import _swap
from kvcore.ops import HostBuffer, swap_cache_all_layers, swap_cache_layout


def median_gbps(fn: Callable[[], None], nbytes: int, reps: int) -> float:
    fn()  # warm-up: faults in every page of the destinations
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_layout_args(ap, blocks=64, blocks_help="blocks moved per call")
    ap.add_argument("--cache-blocks", type=int, default=128, help="blocks per cache tensor")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="0: library default")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    block = (args.heads, args.block_size, args.head_dim)
    # Cache tensors and baseline buffers come from HostBuffer: page-aligned like Paddle's CPU
    # allocator (plain numpy arrays sit at 16 bytes past a page, which slows memcpy stores).
    cache_bufs = [
        HostBuffer(args.cache_blocks * int(np.prod(block)) * 2, pinned=False)
        for _ in range(args.layers)
    ]
    caches = [b.view(np.uint16, (args.cache_blocks, *block)) for b in cache_bufs]
    for c in caches:
        c[...] = rng.integers(0, 1 << 16, c.shape, dtype=np.uint16)
    block_bytes = caches[0][0].nbytes
    n = args.blocks
    total = n * args.layers * block_bytes
    dev_ids = rng.permutation(args.cache_blocks)[:n].tolist()
    host_ids = rng.permutation(n).tolist()
    slot_ids = list(range(n))
    hosts = [HostBuffer(n * block_bytes, pinned=False) for _ in caches]
    staging = HostBuffer(total, pinned=False)
    src_buf, dst_buf = HostBuffer(total, pinned=False), HostBuffer(total, pinned=False)
    src, dst = src_buf.array, dst_buf.array
    src[...] = 1
    cache_shape = [args.cache_blocks, *block]
    kw = {"num_threads": args.threads or None}

    figures = {
        "np_copyto_gbps": median_gbps(lambda: np.copyto(dst, src), total, args.reps),
        "swap_all_layers_to_host_gbps": median_gbps(
            lambda: swap_cache_all_layers(caches, hosts, n, dev_ids, host_ids, 0, 0, **kw),
            total, args.reps,
        ),
        "swap_all_layers_to_device_gbps": median_gbps(
            lambda: swap_cache_all_layers(caches, hosts, n, dev_ids, host_ids, 0, 1, **kw),
            total, args.reps,
        ),
        "swap_layout_gather_gbps": median_gbps(
            lambda: swap_cache_layout(caches, staging, cache_shape, dev_ids, slot_ids, 0, 0, **kw),
            total, args.reps,
        ),
        "swap_layout_scatter_gbps": median_gbps(
            lambda: swap_cache_layout(caches, staging, cache_shape, dev_ids, slot_ids, 0, 1, **kw),
            total, args.reps,
        ),
        "swap_layout_gather_1thread_gbps": median_gbps(
            lambda: swap_cache_layout(
                caches, staging, cache_shape, dev_ids, slot_ids, 0, 0, num_threads=1
            ),
            total, args.reps,
        ),
        "bytes_per_call_mib": total / 2**20,
        "threads": _swap.resolve_threads(args.threads, total),
        "reps": args.reps,
    }  # fmt: skip
    base = figures["np_copyto_gbps"]
    ops = [k for k in figures if k.startswith("swap_") and "1thread" not in k]
    report = {
        "figures": {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()},
        "ratios": {
            k.removesuffix("_gbps") + "_vs_copyto": round(figures[k] / base, 3) for k in ops
        },
        "goals": {k.removesuffix("_gbps") + "_vs_copyto": ">= 1.0" for k in ops},
    }
    emit(report, args.json)


if __name__ == "__main__":
    main()
