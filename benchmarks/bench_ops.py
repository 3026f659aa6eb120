"""Throughput of kvcore.ops swap ops against a contiguous copy of the same bytes, in one run.

Typical shape: 28 layers x [blocks, 8 heads, 64 tokens, 128 dim] bfloat16 (uint16 stand-in: the
ops move bytes), 64 blocks per call picked at random (no mergeable runs), default thread count.
The limit is the same bytes copied as one contiguous run by kvcore's own copy routine on as
many threads as the ops use (``contiguous_copy_threaded``; ``contiguous_copy_1thread`` for the
one-thread op): the ops differ from it only by cutting the bytes into pieces. Calls of 32 MiB
and more write with non-temporal stores there, which glibc's ``memcpy`` (``np_copyto``,
``memcpy_threaded``: one contiguous slice per thread, reported beside as references) does not
always do: on this project's machines the routine copied 224 MiB 1.8-2.0x faster than
glibc, so glibc's copy is not the limit. Each repetition times every contender once, the order
reversed every other repetition; figures are the median and range (min, max) over --reps, and
each ratio is op / its baseline per repetition (paired), then its median and range. An op
beating its limit by more than 5 % is flagged. `--json` prints one JSON object {"figures",
"ratios", "goals", ...}.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from benchutil import Report, add_layout_args, emit

from kvcore.ops import HostBuffer, copy_threads, swap_cache_all_layers, swap_cache_layout

BASELINE = "np_copyto"
THREADED = "memcpy_threaded"
LIMIT = "contiguous_copy_threaded"
LIMIT_1THREAD = "contiguous_copy_1thread"


def seconds(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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
    threads = copy_threads(args.threads, total)
    pool = ThreadPoolExecutor(max_workers=threads)
    edges = [total * i // threads for i in range(threads + 1)]  # src, dst: byte arrays
    slices = [(dst[a:b], src[a:b]) for a, b in itertools.pairwise(edges)]

    def memcpy_threaded() -> None:
        for f in [pool.submit(np.copyto, d, s) for d, s in slices]:
            f.result()

    # the same bytes as one block of one layer: one contiguous run through the ops' own copy
    whole = src_buf.view(np.uint8, (1, total))

    def contiguous(num_threads: int) -> Callable[[], None]:
        return lambda: swap_cache_all_layers(
            [whole], [dst_buf], 1, [0], [0], 0, 0, num_threads=num_threads
        )

    contenders: dict[str, Callable[[], None]] = {
        BASELINE: lambda: np.copyto(dst, src),
        THREADED: memcpy_threaded,
        LIMIT: contiguous(threads),
        LIMIT_1THREAD: contiguous(1),
        "swap_all_layers_to_host":
            lambda: swap_cache_all_layers(caches, hosts, n, dev_ids, host_ids, 0, 0, **kw),
        "swap_all_layers_to_device":
            lambda: swap_cache_all_layers(caches, hosts, n, dev_ids, host_ids, 0, 1, **kw),
        "swap_layout_gather":
            lambda: swap_cache_layout(caches, staging, cache_shape, dev_ids, slot_ids, 0, 0, **kw),
        "swap_layout_scatter":
            lambda: swap_cache_layout(caches, staging, cache_shape, dev_ids, slot_ids, 0, 1, **kw),
        "swap_layout_gather_1thread": lambda: swap_cache_layout(
            caches, staging, cache_shape, dev_ids, slot_ids, 0, 0, num_threads=1
        ),
    }  # fmt: skip
    for fn in contenders.values():
        fn()  # warm-up: faults in every page of the destinations
    gbps: dict[str, list[float]] = {name: [] for name in contenders}
    for rep in range(args.reps):
        # np.copyto first in even repetitions, last in odd ones: a drift of the machine within
        # a repetition does not always favour the same side of a ratio
        order = list(contenders) if rep % 2 == 0 else list(reversed(contenders))
        for name in order:
            gbps[name].append(total / seconds(contenders[name]) / 1e9)

    report = Report()
    for name, values in gbps.items():
        report.figure(f"{name}_gbps", values, "GB/s")
    for name in contenders:
        if name.startswith("swap_") and "1thread" not in name:
            # same bytes in both: op GB/s / contiguous copy GB/s on as many threads, same rep
            report.ratio(f"{name}_vs_contiguous_copy", gbps[name], gbps[LIMIT], goal=">= 0.9",
                         limit=True)  # fmt: skip
            report.ratio(f"{name}_vs_memcpy_threaded", gbps[name], gbps[THREADED])
    report.ratio(
        "swap_layout_gather_1thread_vs_contiguous_copy",
        gbps["swap_layout_gather_1thread"],
        gbps[LIMIT_1THREAD],
        goal=">= 0.9",
        limit=True,
    )
    report.ratio("swap_layout_gather_1thread_vs_copyto", gbps["swap_layout_gather_1thread"],
                 gbps[BASELINE])  # fmt: skip
    report.ratio("contiguous_copy_vs_memcpy_threaded", gbps[LIMIT], gbps[THREADED])
    pool.shutdown()
    report.notes["setup"] = {
        "bytes_per_call_mib": total / 2**20,
        "threads": threads,
        "reps": args.reps,
    }
    emit(report.as_dict(), args.json)


if __name__ == "__main__":
    main()
