"""The TransferManager on kv_file against its stages alone, in one run, contenders alternated.

Typical layout (28 layers x 8 heads x 64 tokens x 128 dim, bfloat16, K and V): 64 blocks,
448 MiB per operation, the cache in host memory (numpy arrays, as vLLM's CPU backend or any
CPU-offload tier keeps it). Every repetition runs each contender once, the order rotating
from one repetition to the next, each on fresh keys where it writes and each write starting
with no dirty pages (``os.sync`` first, not timed). Every figure is reported as its median and
range (min, max) over the ``--reps`` repetitions (one warm-up repetition before them is
dropped), in GB/s (10^9 bytes per second); every ratio is computed per repetition from the
contenders measured in that same repetition (paired), then reported the same way. Writes and
warm reads use a kv_file store in RAM-backed storage (``--ram-root``, /dev/shm): on this
machine's virtual disk a write's speed depended more on the kernel's writeback of the writes
before it than on the code. Cold reads use a store on the disk.

- **host-resident path** (``storage_io="host_resident"``: the backend reads into and writes
  from the cache blocks themselves): its write-back and warm read against **the backend
  alone** moving the same bytes from/to one contiguous buffer (goal >= 0.9x each). The ratio
  is also split in two: against the backend alone given **the cache's own blocks** (the same
  segmented buffers the manager passes: what the manager costs), and that backend-alone run
  against the contiguous one (what the engine's layout, a piece per layer, costs the backend);
- **staged path** (``storage_io="staged"``: through staging buffers, span k's storage I/O
  overlapping the gather of span k+1 or the scatter of span k-1): write-back, warm read and cold
  read (the store's files dropped from the page cache) against **the slower of its two stages
  alone** in that repetition (the swap op's gather/scatter, the backend alone), goal >= 0.9x for
  write-back and cold read. Two figures bracket the pipeline: the **serial combination** of the
  stages (1 / (1/a + 1/b), a and b measured in the same repetition: what no overlap at all
  would give) and the **stages side by side**: both stages running at once on independent
  data, unsynchronized (the backend storing one set of blocks while the gather copies another;
  the backend reading while the scatter copies), timed until both end: what overlap reaches
  where both stages are CPU copies sharing the cores (here, not on a GPU, where the gather is
  a DMA), below the slower stage alone. It is an estimate, not a limit (a pipeline came out
  1.3x above it in one run of nine: how the two stages' threads are scheduled varies from one
  process to the next). **Named as limits** (a ratio above 1.05 is flagged): the slower stage
  alone (a pipeline does all of its work, and more) and the backend alone on the cache's own
  blocks (the same I/O on the same buffers, without the manager);
- a **10,000-block query through the manager**, building its request included (a small layout:
  the names matter, not the bytes), goal <= 5 ms.

With ``--json``, one JSON object on stdout: figures and ratios (each ``{"median", "min", "max",
"n"}``), goals, flags, the setup (bytes per operation, the bytes read back verified, counts) and
the machine; without it, the same as a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
from benchutil import Report, add_layout_args, emit

import kvcore
from kvcore import ops
from kvcore.cli.bench import staging_regions
from kvcore.transfer import DeviceCache, TransferManager

GB = 1e9


def host_cache(layout: kvcore.CacheLayout, seed: int | None) -> DeviceCache:
    """Per-layer page-aligned host arrays (as an engine allocates them), random or zero."""
    rng = np.random.default_rng(seed)
    parts = {}
    for part in layout.parts:
        tensors = []
        for _ in range(layout.total_layers):
            buf = ops.HostBuffer(layout.num_blocks * layout.kv_layer_block_bytes, pinned=False)
            arr = buf.view(np.uint16, layout.kv_shape)
            if seed is None:
                arr.fill(0)
            else:
                arr[...] = rng.integers(0, 2**16, arr.shape, dtype=np.uint16)
            tensors.append(arr)
        parts[part] = tensors
    return DeviceCache(layout, parts["k"], parts["v"])


def store_files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kv")]


def drop_cached_pages(root: str) -> None:
    """Evict the store's files from the page cache, so the next read comes from the disk."""
    os.sync()  # dirty pages cannot be dropped
    for path in store_files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def side_by_side(first: Callable[[], object], second: Callable[[], object]) -> None:
    """Run both at once (``second`` in a thread of its own) until both have ended."""
    failed: list[BaseException] = []

    def run_second() -> None:
        try:
            second()
        except BaseException as exc:  # surfaced below: a benchmark must not time a failure
            failed.append(exc)

    thread = threading.Thread(target=run_second, name="bench-side-by-side")
    thread.start()
    try:
        first()
    finally:
        thread.join()
    if failed:
        raise failed[0]


def fresh_keys(layout: kvcore.CacheLayout, n: int) -> list[str]:
    tokens = np.random.default_rng().integers(0, 100_000, n * layout.block_size).tolist()
    return kvcore.block_hashes(
        tokens, layout.block_size, kvcore.KeyScope(namespace=uuid.uuid4().hex)
    )


class Run:
    """Times named contenders; each call appends one sample."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    def time(self, name: str, fn: Callable[[], object]) -> object:
        t0 = time.perf_counter()
        out = fn()
        self.samples.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    def gbps(self, name: str, nbytes: int) -> list[float]:
        """GB/s of every sample of ``name``, in the order taken (one per repetition)."""
        return [nbytes / s / GB for s in self.samples[name]]


def query_10k(root: str, n: int, reps: int) -> list[float]:
    """A 10,000-block query through the manager, its request built each time: ms per query."""
    layout = kvcore.CacheLayout(num_layers=1, num_heads=1, block_size=16, head_dim=8, num_blocks=4)
    keys = fresh_keys(layout, n)
    backend = kvcore.open_backend("file", {"root": root}, context={"layout": layout})
    staging, host = staging_regions(layout, n)
    assert backend.write(backend.request("fill", keys, timeout_s=600, host=host)) == n
    tm = TransferManager(
        {"layout": layout, "max_model_len": n * layout.block_size},
        DeviceCache(layout, *[[np.zeros((4, 1, 16, 8), np.uint16)]] * 2),
        backend,
    )
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        assert tm.query({"task_id": "q", "keys": keys}) == n
        times.append(time.perf_counter() - t0)
    tm.close()
    backend.close()
    del staging
    return [1e3 * t for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true", help="one JSON object (default: a table)")
    add_layout_args(ap, 64, "blocks per operation")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (after one warm-up)")
    ap.add_argument("--fsync", default=None, help="kv_file fsync policy (default: its default)")
    ap.add_argument("--io-threads", type=int, default=None, help="kv_file io_threads")
    ap.add_argument("--pipeline-blocks", type=int, default=16, help="staged path's span")
    ap.add_argument("--pipeline-depth", type=int, default=None, help="staged path's depth")
    ap.add_argument(
        "--root", default=None, help="disk directory for the cold-read store (default: a temp dir)"
    )
    ap.add_argument(
        "--ram-root",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="RAM-backed directory for the write and warm-read store (default: /dev/shm)",
    )
    ap.add_argument("--query-blocks", type=int, default=10_000)
    args = ap.parse_args()
    n = args.blocks
    layout = kvcore.CacheLayout(
        num_layers=args.layers,
        num_heads=args.heads,
        block_size=args.block_size,
        head_dim=args.head_dim,
        num_blocks=2 * n,
    )
    work = tempfile.mkdtemp(prefix="kvcore-bench-transfer-", dir=args.root)
    fcfg: dict[str, object] = {"root": os.path.join(work, "store"), "capacity_bytes": 64 * 2**30}
    if args.fsync:
        fcfg["fsync"] = args.fsync
    if args.io_threads:
        fcfg["io_threads"] = args.io_threads
    nbytes = n * layout.block_bytes
    src_ids, dst_ids = list(range(n)), list(range(n, 2 * n))
    run = Run()
    try:
        src, dst = host_cache(layout, 1), host_cache(layout, None)
        # writes and warm reads on a RAM-backed store (the code, not the disk's writeback,
        # is what they measure); cold reads on the disk store, which they are about
        ram = tempfile.mkdtemp(prefix="kvcore-bench-transfer-", dir=args.ram_root)
        backend = kvcore.open_backend("file", {**fcfg, "root": ram}, context={"layout": layout})
        disk = kvcore.open_backend("file", fcfg, context={"layout": layout})
        resident_ok = backend.capabilities.segmented_host
        base = {"layout": layout, "max_model_len": n * layout.block_size, "default_timeout_s": 600,
                "read_workers": 1, "write_workers": 1}  # fmt: skip
        staged_cfg: dict[str, object] = {
            "storage_io": "staged",
            "pipeline_blocks": args.pipeline_blocks,
        }
        if args.pipeline_depth:
            staged_cfg["pipeline_depth"] = args.pipeline_depth
        staged = TransferManager({**base, **staged_cfg}, src, backend)
        resident = (
            TransferManager({**base, "storage_io": "host_resident"}, src, backend)
            if resident_ok
            else None
        )
        staged_disk = TransferManager({**base, **staged_cfg}, dst, disk)
        regions, host = staging_regions(layout, n)
        for r in regions:
            r.array[:] = np.random.default_rng(2).integers(0, 256, r.nbytes, dtype=np.uint8)
        # the side-by-side gather and scatter use their own staging, so the backend's buffer
        # is never copied into while it is stored from; it always holds src's blocks
        side_regions, _ = staging_regions(layout, n)
        slots = list(range(n))

        def stage(cache: DeviceCache, ids: list[int], mode: int, into: list = regions) -> None:
            for part, region in zip(layout.parts, into, strict=True):
                ops.swap_cache_layout(
                    cache.tensors[part], region, cache.block_shape(part), ids, slots, 0, mode
                )

        stage(src, src_ids, ops.TO_HOST, side_regions)
        # the cache's own blocks as the backend alone takes them (what host_resident passes)
        src_blocks, dst_blocks = src.host_buffers(src_ids), dst.host_buffers(dst_ids)

        def manager_op(tm: TransferManager, op: str, keys: list[str], ids: list[int]) -> None:
            task = {"task_id": op, "keys": keys, "device_block_ids": ids}
            call = tm.write_back if op == "write" else tm.read
            res = call(task).result()
            assert res.ok and res.num_blocks == n, res

        def all_blocks(got: int) -> None:
            assert got == n, f"the backend moved {got} of {n} blocks"

        managers = {"staged": staged, **({"resident": resident} if resident else {})}
        for rep in range(args.reps + 1):  # the first repetition warms up and is dropped
            keys = {
                name: fresh_keys(layout, n)
                for name in ("backend", "disk", "side", "segmented", *managers)
            }
            alone = keys["backend"]

            def backend_op(
                op: str,
                k: list[str] = alone,
                be: kvcore.Backend = backend,
                buffers: kvcore.HostBuffers = host,
            ) -> int:
                call = be.write if op == "write" else be.read
                return call(be.request(op, k, timeout_s=600, host=buffers))

            # Writes: each starts with no dirty pages (os.sync, not timed), so none is slowed
            # by the kernel's writeback of the ones before it; the order rotates every
            # repetition. Then warm reads (the files in the page cache), same rotation.
            writes = [("backend_write", lambda: backend_op("write"))]
            reads = [("backend_read", lambda: backend_op("read"))]
            if resident:
                k = keys["segmented"]
                writes.append(
                    (
                        "backend_segmented_write",
                        lambda k=k: all_blocks(backend_op("write", k, buffers=src_blocks)),
                    )
                )
                reads.append(
                    (
                        "backend_segmented_read",
                        lambda k=k: all_blocks(backend_op("read", k, buffers=dst_blocks)),
                    )
                )
            for name, tm in managers.items():
                k = keys[name]
                writes.append(
                    (f"{name}_write", lambda tm=tm, k=k: manager_op(tm, "write", k, src_ids))
                )
                reads.append(
                    (f"{name}_read", lambda tm=tm, k=k: manager_op(tm, "read", k, dst_ids))
                )
            writes.append(("gather", lambda: stage(src, src_ids, ops.TO_HOST)))
            writes.append(
                (
                    "side_by_side_write",
                    lambda k=keys["side"]: side_by_side(
                        lambda: all_blocks(backend_op("write", k)),
                        lambda: stage(src, src_ids, ops.TO_HOST, side_regions),
                    ),
                )
            )
            reads.append(("scatter", lambda: stage(dst, dst_ids, ops.TO_DEVICE)))
            turn = rep % len(writes)
            for name, fn in writes[turn:] + writes[:turn]:
                for tm in managers.values():
                    tm.restore_caches(src)
                os.sync()
                run.time(name, fn)
            for name, fn in reads[turn:] + reads[:turn]:
                for tm in managers.values():
                    tm.restore_caches(dst)
                run.time(name, fn)
            # cold reads from the disk store: the files dropped from the page cache first
            cold = keys["disk"]
            assert backend_op("write", cold, disk) == n
            staged_disk.restore_caches(src)
            manager_op(staged_disk, "write", keys["staged"], src_ids)
            staged_disk.restore_caches(dst)
            colds = [
                ("backend_read_cold", lambda k=cold: backend_op("read", k, disk)),
                (
                    "staged_read_cold",
                    lambda k=keys["staged"]: manager_op(staged_disk, "read", k, dst_ids),
                ),
                (
                    "side_by_side_read_cold",
                    lambda k=cold: side_by_side(
                        lambda: all_blocks(backend_op("read", k, disk)),
                        lambda: stage(dst, dst_ids, ops.TO_DEVICE, side_regions),
                    ),
                ),
            ]
            turn = rep % len(colds)
            for name, fn in colds[turn:] + colds[:turn]:
                drop_cached_pages(work)
                run.time(name, fn)
            backend.clear()  # keep the RAM store (and the machine's memory) small: not timed
            disk.clear()
            if rep == 0:
                run.samples.clear()
        verified = all(
            np.array_equal(a[src_ids], b[dst_ids])
            for part in layout.parts
            for a, b in zip(src.tensors[part], dst.tensors[part], strict=True)
        )
        for tm in (*managers.values(), staged_disk):
            tm.close()
        backend.close()
        disk.close()
        shutil.rmtree(ram, ignore_errors=True)
        query_ms = query_10k(os.path.join(work, "query"), args.query_blocks, max(3, args.reps))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    report = Report()
    # one sample per contender per repetition, in repetition order: index i of every list is
    # repetition i, so every ratio below pairs contenders measured in the same repetition
    g = {k.removesuffix("_s"): run.gbps(k, nbytes) for k in run.samples}
    assert all(len(v) == args.reps for v in g.values()), {k: len(v) for k, v in g.items()}
    g["staged_write_side_by_side"] = g.pop("side_by_side_write")
    g["staged_read_cold_side_by_side"] = g.pop("side_by_side_read_cold")

    def serial(a: list[float], b: list[float]) -> list[float]:
        """The two stages one after the other, per repetition: 1 / (1/a + 1/b)."""
        return [1 / (1 / x + 1 / y) for x, y in zip(a, b, strict=True)]

    def slower(a: list[float], b: list[float]) -> list[float]:
        """The slower of the two stages alone, per repetition."""
        return [min(x, y) for x, y in zip(a, b, strict=True)]

    g["staged_write_serial_combination"] = serial(g["backend_write"], g["gather"])
    g["staged_read_serial_combination"] = serial(g["backend_read"], g["scatter"])
    g["staged_read_cold_serial_combination"] = serial(g["backend_read_cold"], g["scatter"])
    for name in sorted(g):
        report.figure(f"{name}_gbps", g[name], "GB/s")
    report.figure("query_10k_blocks_with_request_ms", query_ms, "ms")

    write_stage = slower(g["backend_write"], g["gather"])
    read_cold_stage = slower(g["backend_read_cold"], g["scatter"])
    read_warm_stage = slower(g["backend_read"], g["scatter"])
    # the limit of a pipeline: it does all of its slower stage's work, and more
    report.ratio("staged_write_back_vs_slower_stage", g["staged_write"], write_stage,
                 goal=">= 0.9", limit=True)  # fmt: skip
    report.ratio("staged_read_cold_vs_slower_stage", g["staged_read_cold"], read_cold_stage,
                 goal=">= 0.9", limit=True)  # fmt: skip
    report.ratio("staged_read_warm_vs_slower_stage", g["staged_read"], read_warm_stage,
                 limit=True)  # fmt: skip
    report.ratio("staged_write_back_vs_serial_combination", g["staged_write"],
                 g["staged_write_serial_combination"])  # fmt: skip
    report.ratio("staged_read_cold_vs_serial_combination", g["staged_read_cold"],
                 g["staged_read_cold_serial_combination"])  # fmt: skip
    # the stages side by side: what overlapping them reaches where they share the cores (an
    # estimate, not a limit: measured, a pipeline came out up to 1.3x above it in one run of
    # nine, the two stages' threads scheduled differently in that process)
    report.ratio("staged_write_back_vs_side_by_side", g["staged_write"],
                 g["staged_write_side_by_side"])  # fmt: skip
    report.ratio("staged_read_cold_vs_side_by_side", g["staged_read_cold"],
                 g["staged_read_cold_side_by_side"])  # fmt: skip
    report.ratio("side_by_side_write_vs_slower_stage", g["staged_write_side_by_side"],
                 write_stage)  # fmt: skip
    report.ratio("side_by_side_read_cold_vs_slower_stage", g["staged_read_cold_side_by_side"],
                 read_cold_stage)  # fmt: skip
    report.ratio("query_10k_blocks_with_request_vs_5ms", query_ms, [5.0] * len(query_ms),
                 goal="<= 1.0")  # fmt: skip
    if "resident_read" in g:
        report.ratio("host_resident_read_warm_vs_backend", g["resident_read"],
                     g["backend_read"], goal=">= 0.9")  # fmt: skip
        report.ratio("host_resident_write_back_vs_backend", g["resident_write"],
                     g["backend_write"], goal=">= 0.9")  # fmt: skip
        # the same split in two: the manager's cost (against the backend alone on the very
        # same cache blocks) and the cache's memory layout's (the backend alone, the cache's
        # blocks against one contiguous buffer); the first is the limit: the same I/O on the
        # same buffers, plus the manager
        for op, verb in (("read", "read_warm"), ("write", "write_back")):
            report.ratio(f"host_resident_{verb}_vs_backend_segmented", g[f"resident_{op}"],
                         g[f"backend_segmented_{op}"], limit=True)  # fmt: skip
            report.ratio(f"backend_segmented_{op}_vs_contiguous", g[f"backend_segmented_{op}"],
                         g[f"backend_{op}"])  # fmt: skip
    report.notes.update(
        {
            "units": "gbps = 10^9 bytes/s; ms = milliseconds",
            "bytes_per_op": nbytes,
            "bytes_verified": verified,
            "host_resident": "measured" if resident_ok else "kv_file lacks segmented_host",
            "reps": args.reps,
            "setup": {
                "blocks": n,
                "pipeline_blocks": args.pipeline_blocks,
                "pipeline_depth": args.pipeline_depth,
                "io_threads": args.io_threads,
                "fsync": args.fsync,
                "query_blocks": args.query_blocks,
                "query_reps": len(query_ms),
            },
        }
    )
    emit(report.as_dict(), args.json)


if __name__ == "__main__":
    main()
