"""kv_file throughput and query latency against raw file I/O of the same bytes, in one run.

Typical layout: 64 blocks x 28 layers x [8 heads, 64 tokens, 128 dim] bfloat16, K and V stored
as separate objects (128 objects of 3.5 MiB, 448 MiB), written and read through the opened
``file`` backend (``kvcore.open_backend``). Baselines, measured in the same run and
interleaved with the store's repetitions so both see the same machine state:

- write: the same bytes written in order to ONE file with ``os.write``, synced per the same
  policy (fsync=none: nothing; fsync=data: one ``fdatasync`` at the end);
- warm read: ``readinto`` of the same bytes from one file already in the page cache (the
  store reads page-cache hits buffered, misses with ``O_DIRECT``);
- cold read: the same after dropping that file's cached pages (``posix_fadvise
  DONTNEED`` after a sync: per file, needs no privilege and spares other users' cache);
- query: ``Backend.query`` of 10,000 blocks x 2 parts, all present (goal <= 5 ms), warm (names
  seen before) and cold (first query after open: names must be hashed).

Raw and store repetitions alternate (which goes first flips each time). Reports medians of
``--reps``; ``--json`` prints one JSON object {figures, ratios, goals,
machine} on stdout.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable

import numpy as np
from benchutil import add_layout_args, emit

import kvcore
from kvcore import CacheLayout, HostBuffers


def median_s(fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None):
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_region(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Page-aligned anonymous memory, like an engine's staging buffer."""
    mm = mmap.mmap(-1, nbytes)
    return mm, np.frombuffer(mm, dtype=np.uint8)


def drop_cached_pages(paths: list[str]) -> None:
    os.sync()  # dirty pages cannot be dropped
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def store_files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kv")]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.layout = CacheLayout(
            num_layers=args.layers,
            num_heads=args.heads,
            block_size=args.block_size,
            head_dim=args.head_dim,
            dtype="bfloat16",
        )
        self.part = self.layout.part_bytes("k")
        self.n = args.blocks
        self.total = self.n * 2 * self.part
        self._src_mm, src = host_region(self.total)
        self._dst_mm, self.dst = host_region(self.total)
        src[:] = np.random.default_rng(0).integers(0, 256, self.total, dtype=np.uint8)
        self.src_ptr = src.ctypes.data
        self.dst_ptr = self.dst.ctypes.data
        self.work = tempfile.mkdtemp(prefix="kvcore-bench-file-", dir=args.dir)

    def host(self, base: int) -> HostBuffers:
        p = self.part
        return HostBuffers(
            ptrs=tuple((base + 2 * i * p, base + (2 * i + 1) * p) for i in range(self.n)),
            nbytes=(p, p),
        )

    def regions(self, base: int) -> list[memoryview]:
        host = self.host(base)
        return [host.memoryview(i, j) for i in range(self.n) for j in range(2)]

    def open(self, root: str, fsync: str, layout: CacheLayout | None = None) -> kvcore.Backend:
        config = {"root": root, "fsync": fsync, "capacity_bytes": 64 * 2**30}
        config["rescan_interval_s"] = 0
        return kvcore.open_backend("file", config, context={"layout": layout or self.layout})

    # -- write ---------------------------------------------------------------------------

    def raw_write(self, path: str, sync: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for mv in self.regions(self.src_ptr):
                os.write(fd, mv)
            if sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def writes(self, fsync: str) -> tuple[float, float, str, kvcore.Backend, list[str]]:
        """Median seconds of raw and store writes (alternating), and the last store."""
        raw_t, file_t = [], []
        raw_path = os.path.join(self.work, f"raw-{fsync}.bin")
        backend = root = None
        for r in range(self.args.reps):
            if backend is not None:
                backend.close()
                shutil.rmtree(root)
            root = os.path.join(self.work, f"store-{fsync}-{r}")
            backend = self.open(root, fsync)
            keys = [uuid.uuid4().hex * 2 for _ in range(self.n)]
            req = backend.request("bench-write", keys, host=self.host(self.src_ptr), timeout_s=600)
            order = [("raw", None), ("file", req)] if r % 2 == 0 else [("file", req), ("raw", None)]
            if os.path.exists(raw_path):
                os.unlink(raw_path)  # a fresh file, as the store writes fresh files
            for what, request in order:
                t0 = time.perf_counter()
                if what == "raw":
                    self.raw_write(raw_path, fsync != "none")
                    raw_t.append(time.perf_counter() - t0)
                else:
                    done = backend.write(request)
                    file_t.append(time.perf_counter() - t0)
                    assert done == self.n, f"store wrote {done} of {self.n} blocks"
        return statistics.median(raw_t), statistics.median(file_t), raw_path, backend, keys

    # -- read ----------------------------------------------------------------------------

    def raw_read(self, path: str) -> None:
        with open(path, "rb", buffering=0) as f:
            for mv in self.regions(self.dst_ptr):
                if f.readinto(mv) != len(mv):
                    raise RuntimeError("short read from the raw file")

    def reads(self, raw_path: str, backend: kvcore.Backend, keys: list[str]) -> dict[str, float]:
        """Median seconds of raw and store reads, warm and cold, alternating which goes first
        in each repetition so both see the same machine state."""
        req = backend.request("bench-read", keys, host=self.host(self.dst_ptr), timeout_s=600)

        def store_read() -> None:
            done = backend.read(req)
            assert done == self.n, f"store read {done} of {self.n} blocks"

        store_read()
        src = np.frombuffer(self._src_mm, dtype=np.uint8)
        assert np.array_equal(self.dst, src), "store read back other bytes than it wrote"
        self.raw_read(raw_path)
        files = store_files(backend.plugin._dir.path)
        runs = {  # name -> (timed call, untimed preparation)
            "raw_read_warm_s": (lambda: self.raw_read(raw_path), lambda: None),
            "file_read_warm_s": (store_read, lambda: None),
            "raw_read_cold_s": (
                lambda: self.raw_read(raw_path),
                lambda: drop_cached_pages([raw_path]),
            ),
            "file_read_cold_s": (store_read, lambda: drop_cached_pages(files)),
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        # Warm first: the store's files are cached as its writes left them. Cold reads go
        # around the page cache (O_DIRECT) and leave the files uncached, so they come last.
        for pair in (
            ("raw_read_warm_s", "file_read_warm_s"),
            ("raw_read_cold_s", "file_read_cold_s"),
        ):
            for r in range(self.args.reps):
                for name in pair if r % 2 == 0 else pair[::-1]:
                    fn, prepare = runs[name]
                    prepare()
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        assert np.array_equal(self.dst, src), "store read back other bytes than it wrote"
        return {k: statistics.median(v) for k, v in times.items()}

    # -- query ---------------------------------------------------------------------------

    def queries(self) -> dict[str, float]:
        n = self.args.query_keys
        tiny = CacheLayout(num_layers=1, num_heads=1, block_size=1, head_dim=16)
        root = os.path.join(self.work, "query-store")
        backend = self.open(root, "none", tiny)
        part = tiny.part_bytes("k")
        _, buf = host_region(2 * part * n)
        base = buf.ctypes.data
        host = HostBuffers(
            ptrs=tuple((base + 2 * i * part, base + (2 * i + 1) * part) for i in range(n)),
            nbytes=(part, part),
        )
        keys = [uuid.uuid4().hex * 2 for _ in range(n)]
        assert backend.write(backend.request("fill", keys, host=host, timeout_s=600)) == n
        req = backend.request("bench-query", keys, timeout_s=600)
        reps = max(self.args.reps, 11)

        def facade() -> None:
            assert backend.query(req) == n

        def plugin() -> None:
            assert backend.plugin.kvcore_query(request=req) == n

        out = {
            "query_10k_keys_ms": 1e3 * median_s(facade, reps),
            "query_10k_keys_plugin_ms": 1e3 * median_s(plugin, reps),
        }
        backend.close()
        cold = []
        for _ in range(3):
            fresh = self.open(root, "none", tiny)
            r = fresh.request("bench-query", keys, timeout_s=600)
            t0 = time.perf_counter()
            assert fresh.query(r) == n
            cold.append(time.perf_counter() - t0)
            fresh.close()
        out["query_10k_keys_cold_ms"] = 1e3 * statistics.median(cold)
        return out

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_layout_args(ap, blocks=64)
    ap.add_argument("--query-keys", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dir", default=None, help="scratch directory (default: the temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    bench = Bench(args)
    gb = bench.total / 1e9
    try:
        raw_w, file_w, raw_path, backend, keys = bench.writes("none")
        raw_wd, file_wd, _, durable, _ = bench.writes("data")
        durable.close()
        reads = bench.reads(raw_path, backend, keys)
        backend.close()
        query = bench.queries()
    finally:
        bench.close()
    figures = {
        "bytes_per_call_mib": bench.total / 2**20,
        "raw_write_gbps": gb / raw_w,
        "file_write_gbps": gb / file_w,
        "raw_write_fdatasync_gbps": gb / raw_wd,
        "file_write_fsync_data_gbps": gb / file_wd,
        "raw_read_warm_gbps": gb / reads["raw_read_warm_s"],
        "file_read_warm_gbps": gb / reads["file_read_warm_s"],
        "raw_read_cold_gbps": gb / reads["raw_read_cold_s"],
        "file_read_cold_gbps": gb / reads["file_read_cold_s"],
        **query,
        "reps": args.reps,
    }
    ratios = {
        "write_vs_raw": figures["file_write_gbps"] / figures["raw_write_gbps"],
        "write_fsync_data_vs_raw": figures["file_write_fsync_data_gbps"]
        / figures["raw_write_fdatasync_gbps"],
        "read_warm_vs_raw": figures["file_read_warm_gbps"] / figures["raw_read_warm_gbps"],
        "read_cold_vs_raw": figures["file_read_cold_gbps"] / figures["raw_read_cold_gbps"],
        "query_10k_keys_vs_5ms": figures["query_10k_keys_ms"] / 5.0,
    }
    goals = {
        "write_vs_raw": ">= 0.9",
        "write_fsync_data_vs_raw": ">= 0.9",
        "read_warm_vs_raw": ">= 1.0",
        "read_cold_vs_raw": ">= 0.9",
        "query_10k_keys_vs_5ms": "<= 1.0",
    }
    report = {
        "figures": {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "goals": goals,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cold_read_method": "fsync + posix_fadvise(DONTNEED) per file",
        },
    }
    emit(report, args.json)


if __name__ == "__main__":
    main()
