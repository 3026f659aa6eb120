"""kv_file against the physical limit of its own file I/O, and one capacity for several processes.

**The raw baseline is the limit**: it does exactly the system calls kv_file does for the same
objects, minus kvcore's own work (names, checksums, the index, the journal). A write is, per
object, ``open(temp, O_WRONLY|O_CREAT|O_EXCL|O_CLOEXEC|O_NOFOLLOW)``, one ``writev`` of a header
page and the payload, ``fdatasync`` under ``fsync=data``, ``close`` and ``rename`` into one of
256 fan-out directories; a read is ``open``, one ``preadv`` of the header page and the payload
(``O_DIRECT`` for objects the page cache does not hold, as kv_file's direct reads), ``close``.
Same files (count and sizes), same flags, same syncs, the same number of threads as kv_file
uses for that operation. The calls are issued from native code with the GIL released, as
kv_file issues them: one ``kvcore.fileio`` batch for all objects with no checksum, the
threads taking the next object from a shared counter, so small objects measure the system
calls, not an interpreter (``--raw native``: one native call per object from Python, the
contender of 0.3; ``--raw python``: Python's ``os`` calls, the one before). A store faster than the limit by more than 5 % is
flagged: then the baseline is not the limit.

**Same starting state for every contender**: before each timed write, ``sync`` (nobody pays for
another's dirty pages); before each warm read, every file of the contender is read once and
``cachestat(2)`` must report all of its pages cached; before each cold read, every file is synced
and dropped (``posix_fadvise(DONTNEED)``) and ``cachestat`` must report none cached. The
checks are in the report (``page_cache``). Contenders alternate (their order rotates each
repetition); each writes fresh files into a fresh directory. Ratios are per repetition. On the
disk (synced writes, cold reads) a second raw contender runs in every repetition: its ratio to
the first (``*_aa_control``) is the disk's own noise, to read the kv_file ratios against.

Typical layout: 64 blocks x 28 layers x [8 heads, 64 tokens, 128 dim] bfloat16, K and V stored
as separate objects (128 objects of 3.5 MiB, 448 MiB). Query: ``Backend.query`` of 10,000
blocks x 2 parts, all present (goal <= 5 ms).

**Shared root** (``--only shared``): four processes each write fresh blocks into one directory
whose capacity is a quarter of what they write together (one capacity, shared accounting:
kv_file's journal and ledger), against the same four processes each on a directory of its own
with a quarter of that capacity (no sharing: the bound kv_file < 0.3 could hold), in RAM-backed
storage. Aggregate GB/s = all bytes / the time from the start signal until the last process
finished. Goal: shared >= 0.9x separate with the typical layout (64 blocks of 2 x 3.5 MiB
objects per process, 4 blocks per write). Reported beside it without a goal, 64 KiB objects
(512 blocks per process, 16 per write): the journal's work under its lock (tens of
microseconds per object) is then a large share of each object's write, and four processes on
two cores queue for the lock.

**Ceiling** (``--only ceiling``, RAM-backed): kv_file's own native batches (header check and
xxh3-128) against the same batches without them, on the same files and threads, with no Python
per object on either side. Their ratio is the checksum's cost alone: the most kv_file / raw can
reach for warm reads and unsynced writes on the machine (both cores are busy copying, so
nothing hides the hash). Each pair runs in both orders, at least 9 repetitions.

Beside each rate, the CPU time it cost: user plus system seconds of every thread of the process
per GB moved (``*_cpu_s_per_gb``, and ``*_cpu_vs_raw``), for kv_file and the raw contender.
One JSON object with ``--json``: figures and ratios with median, min and max over ``--reps``.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from benchutil import Report, add_layout_args, emit
from kv_file import objbatch
from kv_file.objfile import head_fields, header_size

import kvcore
from kvcore import CacheLayout, HostBuffers, fileio
from kvcore.replay import capacity_holding
from kvcore.threads import usable_cpus

PAGE = 4096
FANOUT = 256
_O_TEMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_O_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_O_DIRECT = getattr(os, "O_DIRECT", 0)


# -- the page cache ------------------------------------------------------------------------


class _CacheStat(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in ("nr_cache", "nr_dirty", "nr_writeback",
                                              "nr_evicted", "nr_recently_evicted")]  # fmt: skip


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def cached_pages(path: str) -> int | None:
    """Pages of ``path`` the page cache holds (``cachestat(2)``); None where unsupported."""
    fd = os.open(path, os.O_RDONLY)
    try:
        cs, rng = _CacheStat(), _Range(0, 0)
        if _libc.syscall(451, fd, ctypes.byref(rng), ctypes.byref(cs), 0) != 0:
            return None
        return int(cs.nr_cache)
    finally:
        os.close(fd)


def files_under(root: str, suffix: str = "") -> list[str]:
    return sorted(
        os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(suffix)
    )


def cache_state(paths: list[str]) -> float | None:
    """The fraction of the files' pages the page cache holds (None: cachestat unsupported)."""
    held = total = 0
    for p in paths:
        n = cached_pages(p)
        if n is None:
            return None
        held += n
        total += -(-os.path.getsize(p) // PAGE)
    return held / total if total else 1.0


def drop_cached(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: list[str]) -> None:
    buf = bytearray(1 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# -- the raw contender ---------------------------------------------------------------------


class RawFiles:
    """kv_file's system calls for the same objects, without kvcore's work (see the docstring)."""

    def __init__(
        self,
        root: str,
        nbytes: int,
        count: int,
        pool: ThreadPoolExecutor,
        threads: int,
        mode: str = "batch",
    ) -> None:
        self.root = root
        self.threads = threads  # the pool's threads and the caller's, as kv_file counts them
        # batch: one native batch for all objects (kvcore.fileio, no checksum), as kv_file's;
        # native: one native call per object; python: Python's os calls
        self.mode = mode
        self.native = mode == "native"
        self.count = count
        self.nbytes = nbytes
        self.pool = pool  # kv_file's number of threads for the operation, started once as its
        self.dirs = [os.path.join(root, f"{i:02x}") for i in range(FANOUT)]
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
        self.header = mmap.mmap(-1, PAGE)  # a header page: zeros (kv_file's holds the name)
        self.paths = [os.path.join(self.dirs[i % FANOUT], f"{i:032x}.kv") for i in range(count)]
        self._rows_of: dict[int, np.ndarray] = {}

    def write(self, views: list[memoryview], sync: bool) -> None:
        if self.mode == "batch":
            rows, starts = self._rows(views)
            temps = [f"{path}.{os.getpid()}.{i}.tmp" for i, path in enumerate(self.paths)]
            self._run(fileio.write_batch(
                temps, self.paths, [b""] * self.count, np.full(self.count, PAGE, np.int64),
                rows, starts, digest_prefixes=[b""] * self.count, digest_offset=None, sync=sync,
            ))  # fmt: skip
            return

        def one(i: int) -> None:
            path = self.paths[i]
            temp = f"{path}.{os.getpid()}.{i}.tmp"
            if self.native:
                err = fileio.write_file(temp, path, self.header, [views[i]], sync=sync)
                if err:
                    raise OSError(err, os.strerror(err), temp)
                return
            fd = os.open(temp, _O_TEMP, 0o600)
            try:
                os.writev(fd, [self.header, views[i]])
                if sync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.rename(temp, path)

        self._each(one)

    def _rows(self, views: list[memoryview]) -> tuple[np.ndarray, np.ndarray]:
        """The views as a batch's ``(address, nbytes)`` rows (found before the clock starts:
        the contenders get their buffers' addresses for free)."""
        rows = self._rows_of.get(id(views))
        if rows is None:
            rows = np.array(
                [(ctypes.addressof(ctypes.c_char.from_buffer(v)), len(v)) for v in views],
                dtype=np.int64,
            )
            self._rows_of[id(views)] = rows
        return rows, np.arange(self.count + 1, dtype=np.int64)

    def prepare(self, views: list[memoryview]) -> None:
        """Find the views' addresses now, outside the timed calls."""
        if self.mode == "batch":
            self._rows(views)

    def _run(self, batch: fileio.FileBatch) -> None:
        """A native batch on the threads kv_file uses (the pool's and the caller's)."""
        helpers = [self.pool.submit(batch.run) for _ in range(self.threads - 1)]
        batch.run()
        for helper in helpers:
            helper.result()
        codes, errnos, _, _ = batch.results()
        bad = np.flatnonzero(codes != fileio.FileRead.OK)
        if len(bad):
            k = int(bad[0])
            raise RuntimeError(f"raw I/O of {self.paths[k]}: code {codes[k]}, errno {errnos[k]}")

    def _each(self, one) -> None:
        """``one(i)`` for every object, as kv_file runs a batch: the pool's threads and the
        caller's pull the next index from a shared counter (one ``next()`` per object, no
        future per object, whose cost would dwarf a 64 KiB object's system calls)."""
        counter = itertools.count()

        def worker() -> None:
            for i in counter:
                if i >= self.count:
                    return
                one(i)

        helpers = [self.pool.submit(worker) for _ in range(self.threads - 1)]
        worker()
        for helper in helpers:
            helper.result()

    def read(self, views: list[memoryview], direct: bool, head: list[mmap.mmap]) -> None:
        if self.mode == "batch":
            rows, starts = self._rows(views)
            self._run(fileio.read_batch(
                self.paths, [b""] * self.count, np.full(self.count, PAGE, np.int64), rows,
                starts, digest_prefixes=[b""] * self.count, digest_offset=None, direct=direct,
            ))  # fmt: skip
            return

        def one(i: int) -> None:
            if self.native:
                code, err, _, _ = fileio.read_file(
                    self.paths[i], head[i % len(head)], [views[i]], direct=direct
                )
                if code != fileio.FileRead.OK:
                    raise RuntimeError(f"raw read of {self.paths[i]}: code {code}, errno {err}")
                return
            flags = _O_READ | (_O_DIRECT if direct else 0)
            fd = os.open(self.paths[i], flags)
            try:
                got = os.preadv(fd, [head[i % len(head)], views[i]], 0)
            finally:
                os.close(fd)
            if got != PAGE + len(views[i]):
                raise RuntimeError(f"short raw read of {self.paths[i]}: {got} bytes")

        self._each(one)


# -- one run -------------------------------------------------------------------------------


def cpu_seconds() -> float:
    """User plus system CPU seconds of this process, all its threads, so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
        self._src = mmap.mmap(-1, self.total)
        self._dst = mmap.mmap(-1, self.total)
        src = np.frombuffer(self._src, dtype=np.uint8)
        src[:] = np.random.default_rng(0).integers(0, 256, self.total, dtype=np.uint8)
        self.work = tempfile.mkdtemp(prefix="kvcore-bench-file-", dir=args.dir)
        self.ram_work = tempfile.mkdtemp(prefix="kvcore-bench-file-", dir=args.ram_dir)
        self.cpus = usable_cpus()
        self.io_threads = min(32, max(16, 2 * (os.cpu_count() or 1)))  # kv_file's default
        self.state: dict[str, list[float | None]] = {}
        #: CPU seconds (user + system, every thread) per GB moved, by contender and operation
        self.cpu: dict[str, list[float]] = {}
        # the raw contender's threads, as many as kv_file's for each kind of call, started once
        self.cpu_pool = ThreadPoolExecutor(min(self.io_threads, self.cpus))
        self.io_pool = ThreadPoolExecutor(self.io_threads)

    def views(self, mm: mmap.mmap) -> list[memoryview]:
        p = self.part
        return [memoryview(mm)[i * p : (i + 1) * p] for i in range(2 * self.n)]

    def host(self, mm: mmap.mmap) -> HostBuffers:
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        p = self.part
        return HostBuffers(
            ptrs=tuple((base + 2 * i * p, base + (2 * i + 1) * p) for i in range(self.n)),
            nbytes=(p, p),
        )

    def open(self, root: str, fsync: str = "none", layout: CacheLayout | None = None):
        config = {"root": root, "fsync": fsync, "capacity_bytes": "64GiB", "rescan_interval_s": 0}
        return kvcore.open_backend("file", config, context={"layout": layout or self.layout})

    def note_state(self, name: str, paths: list[str]) -> None:
        self.state.setdefault(name, []).append(cache_state(paths))

    def run(self, report: Report) -> None:
        gb = self.total / 1e9
        samples: dict[str, list[float]] = {}
        src_views, dst_views = self.views(self._src), self.views(self._dst)
        heads = [mmap.mmap(-1, PAGE) for _ in range(self.io_threads)]
        # unsynced writes and warm reads touch only the page cache: in RAM-backed storage,
        # where the file system's own weather (ext4's delayed allocation and journal) does not
        # swamp what is measured; synced writes and cold reads need the disk
        for fsync, work, read in (("none", self.ram_work, "warm"), ("data", self.work, "cold")):
            # kv_file: synced writes wait on the disk (io_threads), unsynced ones copy (cores)
            pool = self.io_pool if fsync == "data" else self.cpu_pool
            threads = self.io_threads if fsync == "data" else min(self.io_threads, self.cpus)
            for r in range(self.args.reps):
                root = os.path.join(work, f"file-{fsync}-{r}")
                backend = self.open(root, fsync)
                # on the disk, a second raw contender: the A/A control, the disk's own noise
                names = ("raw", "file", "raw_again") if fsync == "data" else ("raw", "file")
                raws = {
                    who: RawFiles(os.path.join(work, f"{who}-{fsync}-{r}"), self.part,
                                  2 * self.n, pool, threads, self.args.raw)
                    for who in names if who != "file"
                }  # fmt: skip
                keys = [uuid.uuid4().hex * 2 for _ in range(self.n)]
                req = backend.request(
                    "w", keys, host=self.host(self._src), timeout_s=600, tenant=TENANT
                )
                for raw in raws.values():
                    raw.prepare(src_views)
                    raw.prepare(dst_views)
                order = names[r % len(names) :] + names[: r % len(names)]  # rotating
                for who in order:
                    os.sync()  # everyone starts without dirty pages
                    c0, t0 = cpu_seconds(), time.perf_counter()
                    if who == "file":
                        assert backend.write(req) == self.n
                    else:
                        raws[who].write(src_views, fsync == "data")
                    samples.setdefault(f"{who}_write_{fsync}", []).append(
                        gb / (time.perf_counter() - t0)
                    )
                    self.cpu.setdefault(f"{who}_write_{fsync}", []).append(
                        (cpu_seconds() - c0) / gb
                    )
                self.reads(backend, keys, raws, dst_views, heads, samples, order, read)
                backend.close()
                shutil.rmtree(root)
                for raw in raws.values():
                    shutil.rmtree(raw.root)
        units = "GB/s"
        for name, values in samples.items():
            report.figure(f"{name}_gbps", values, units)
        # the CPU time each moved GB cost (user + system, every thread of this process; the
        # kernel's copies included), kv_file against the raw system calls for the same files
        for name, values in self.cpu.items():
            report.figure(f"{name}_cpu_s_per_gb", values, "CPU s/GB")
        for op in ("write_none", "write_data", "read_warm", "read_cold"):
            report.ratio(f"{op}_cpu_vs_raw", self.cpu[f"file_{op}"], self.cpu[f"raw_{op}"])
        report.ratio("write_vs_raw", samples["file_write_none"], samples["raw_write_none"],
                     goal=">= 0.9", limit=True)  # fmt: skip
        report.ratio("write_fsync_data_vs_raw", samples["file_write_data"],
                     samples["raw_write_data"], goal=">= 0.9", limit=True)  # fmt: skip
        for kind in ("warm", "cold"):
            report.ratio(f"read_{kind}_vs_raw", samples[f"file_read_{kind}"],
                         samples[f"raw_read_{kind}"], goal=">= 0.9", limit=True)  # fmt: skip
        # the A/A controls: the same raw I/O twice in one repetition (the disk's own noise)
        report.ratio("write_fsync_data_aa_control", samples["raw_again_write_data"],
                     samples["raw_write_data"])  # fmt: skip
        report.ratio("read_cold_aa_control", samples["raw_again_read_cold"],
                     samples["raw_read_cold"])  # fmt: skip
        report.notes["page_cache"] = {
            k: [None if v is None else round(v, 3) for v in vals] for k, vals in self.state.items()
        }

    def reads(self, backend, keys, raws, dst_views, heads, samples, order, kind) -> None:
        gb = self.total / 1e9
        req = backend.request("r", keys, host=self.host(self._dst), timeout_s=600, tenant=TENANT)
        store_files = files_under(backend.plugin._dir.path, ".kv")
        src = np.frombuffer(self._src, dtype=np.uint8)
        dst = np.frombuffer(self._dst, dtype=np.uint8)
        for who in order:
            paths = store_files if who == "file" else raws[who].paths
            if kind == "warm":
                warm(paths)
            else:
                drop_cached(paths)
            self.note_state(f"{who}_read_{kind}", paths)
            dst[:] = 0
            c0, t0 = cpu_seconds(), time.perf_counter()
            if who == "file":
                assert backend.read(req) == self.n
            else:  # on the pool of the phase: the cores warm, io_threads cold
                raws[who].read(dst_views, kind == "cold", heads)
            samples.setdefault(f"{who}_read_{kind}", []).append(gb / (time.perf_counter() - t0))
            self.cpu.setdefault(f"{who}_read_{kind}", []).append((cpu_seconds() - c0) / gb)
            assert np.array_equal(dst, src), f"{who} read back other bytes"

    def ceilings(self, report: Report) -> None:
        """kv_file's own native batches (``kv_file.objbatch``: header check and xxh3-128)
        against the same batches without the checksum and the header check: the same files,
        threads and system calls, and no Python per object on either side. What separates
        them is the checksum's cost alone, so their ratio is the most kv_file / raw can reach
        for warm reads and unsynced writes on this machine (``--only ceiling``, RAM-backed)."""
        threads = min(self.io_threads, self.cpus)
        count, gb = 2 * self.n, self.total / 1e9
        src_rows, starts = self.host(self._src).iovecs()
        dst_rows, _ = self.host(self._dst).iovecs()
        blocks = np.arange(count, dtype=np.int64) // 2
        root = os.path.join(self.ram_work, "ceiling-store")
        backend = self.open(root)
        keys = [uuid.uuid4().hex * 2 for _ in range(self.n)]
        req = backend.request("w", keys, host=self.host(self._src), timeout_s=600, tenant=TENANT)
        assert backend.write(req) == self.n
        _, names, digests = backend.plugin._transfers._locate_all(req)
        paths = backend.plugin._dir.object_paths(digests)
        lengths = [self.part] * count
        head_lens = np.array([header_size(len(n)) for n in names], dtype=np.int64)
        heads = [head_fields(n, self.part) for n in names]

        def run(batch: fileio.FileBatch) -> tuple[float, float]:
            c0, t0 = cpu_seconds(), time.perf_counter()
            helpers = [self.cpu_pool.submit(batch.run) for _ in range(threads - 1)]
            batch.run()
            for helper in helpers:
                helper.result()
            seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            codes = batch.results()[0]
            assert (codes == fileio.FileRead.OK).all(), f"codes {np.unique(codes)}"
            return gb / seconds, cpu / gb

        def tree(tag: str) -> tuple[list[str], list[str]]:
            """Fresh paths for a write, in a fan-out tree of its own."""
            base = os.path.join(self.ram_work, f"ceiling-{tag}")
            for i in range(FANOUT):
                os.makedirs(os.path.join(base, f"{i:02x}"))
            out = [os.path.join(base, f"{d >> 120:02x}", f"{d:032x}.kv") for d in digests]
            return [f"{p}.tmp" for p in out], out

        contenders = {
            "read_kv": lambda: objbatch.read_objects(
                paths, names, lengths, objbatch.Rows(dst_rows, starts), blocks,
                deadline=time.monotonic() + 600, direct=None,
            ),
            "read_no_checksum": lambda: fileio.read_batch(
                paths, [b""] * count, head_lens, dst_rows, starts,
                digest_prefixes=[b""] * count, digest_offset=None,
            ),
            # kv_file's unsynced write: each block's parts hashed as they are written, then
            # their heads with the block's write stamp
            "write_kv": lambda: objbatch.write_objects(
                *tree("kv"), names, lengths, [None] * count, None,
                objbatch.Rows(src_rows, starts), blocks, deadline=time.monotonic() + 600,
                sync=False,
            ),
            "write_no_checksum": lambda: fileio.write_batch(
                *tree("plain"), heads, head_lens, src_rows, starts,
                digest_prefixes=[b""] * count, digest_offset=None,
            ),
        }  # fmt: skip
        rates: dict[str, list[float]] = {name: [] for name in contenders}
        cpu: dict[str, list[float]] = {name: [] for name in contenders}
        order = list(contenders)
        try:
            warm(paths)
            np.frombuffer(self._dst, dtype=np.uint8)[:] = 0  # no first-touch faults in a read
            for r in range(max(self.args.reps, 9)):
                for name in order[r % 2 :] + order[: r % 2]:  # each pair in both orders
                    rate, per_gb = run(contenders[name]())
                    rates[name].append(rate)
                    cpu[name].append(per_gb)
                    for tag in ("kv", "plain"):
                        shutil.rmtree(os.path.join(self.ram_work, f"ceiling-{tag}"), True)
        finally:
            backend.close()
            shutil.rmtree(root, ignore_errors=True)
        for name in contenders:
            report.figure(f"ceiling_{name}_gbps", rates[name], "GB/s")
            report.figure(f"ceiling_{name}_cpu_s_per_gb", cpu[name], "CPU s/GB")
        for op in ("read", "write"):
            # the checksum's share: the most kv_file / raw can reach here (RAM-backed, 2 threads
            # per core count, both cores busy)
            report.ratio(f"ceiling_{op}_vs_no_checksum", rates[f"{op}_kv"],
                         rates[f"{op}_no_checksum"])  # fmt: skip
            report.ratio(f"ceiling_{op}_cpu_vs_no_checksum", cpu[f"{op}_kv"],
                         cpu[f"{op}_no_checksum"])  # fmt: skip

    def queries(self, report: Report) -> None:
        n = self.args.query_keys
        tiny = CacheLayout(num_layers=1, num_heads=1, block_size=1, head_dim=16)
        root = os.path.join(self.work, "query-store")
        backend = self.open(root, "none", tiny)
        part = tiny.part_bytes("k")
        mm = mmap.mmap(-1, 2 * part * n)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        host = HostBuffers(
            ptrs=tuple((base + 2 * i * part, base + (2 * i + 1) * part) for i in range(n)),
            nbytes=(part, part),
        )
        keys = [uuid.uuid4().hex * 2 for _ in range(n)]
        assert (
            backend.write(backend.request("fill", keys, host=host, timeout_s=600, tenant=TENANT))
            == n
        )
        req = backend.request("q", keys, timeout_s=600, tenant=TENANT)
        times = []
        for _ in range(max(self.args.reps, 11)):
            t0 = time.perf_counter()
            assert backend.query(req) == n
            times.append(1e3 * (time.perf_counter() - t0))
        backend.close()
        report.figure("query_10k_keys_ms", times, "ms")
        report.ratio("query_10k_keys_vs_5ms", times, [5.0] * len(times), goal="<= 1.0")

    def close(self) -> None:
        self.cpu_pool.shutdown()
        self.io_pool.shutdown()
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.ram_work, ignore_errors=True)


# -- several processes on one root ----------------------------------------------------------


def worker(root: str, capacity: int, blocks: int, batch: int, layout_json: str) -> None:
    """One writer process: opens the store, says ready, waits for go, writes fresh blocks."""
    layout = CacheLayout.model_validate_json(layout_json)
    backend = kvcore.open_backend(
        "file",
        {"root": root, "capacity_bytes": capacity, "rescan_interval_s": 0},
        context={"layout": layout},
    )
    part = layout.part_bytes("k")
    mm = mmap.mmap(-1, 2 * part * batch)
    np.frombuffer(mm, dtype=np.uint8)[:] = np.random.default_rng().integers(
        0, 256, 2 * part * batch, dtype=np.uint8
    )
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    host = HostBuffers(
        ptrs=tuple((base + 2 * i * part, base + (2 * i + 1) * part) for i in range(batch)),
        nbytes=(part, part),
    )
    print("ready", flush=True)
    sys.stdin.readline()  # go
    t0 = time.perf_counter()
    written = 0
    for _ in range(blocks // batch):
        keys = [uuid.uuid4().hex * 2 for _ in range(batch)]
        written += int(
            backend.write(backend.request("w", keys, host=host, timeout_s=600, tenant=TENANT))
        )
    elapsed = time.perf_counter() - t0
    backend.close()
    print(json.dumps({"written": written, "seconds": elapsed, "end": time.time()}), flush=True)


def shared_root(args: argparse.Namespace, report: Report) -> None:
    """Both object sizes: the typical layout's (the goal) and 64 KiB parts (a stress case:
    the journal's per-object work under its lock is then a large share of each write)."""
    typical = CacheLayout(
        num_layers=args.layers, num_heads=args.heads, block_size=args.block_size,
        head_dim=args.head_dim,
    )  # fmt: skip
    small = CacheLayout(num_layers=4, num_heads=4, block_size=16, head_dim=128)  # 64 KiB parts
    # blocks per write: what an engine's request holds; small beside the capacity, so that
    # admission evicts rather than refuses (a refused block costs nothing and says nothing)
    cases = (
        ("typical", typical, args.shared_typical_blocks, 4, ">= 0.9"),
        ("small_objects", small, args.shared_blocks, 16, None),
    )
    for label, layout, blocks, batch, goal in cases:
        _shared_root_case(args, report, label, layout, blocks, min(batch, blocks), goal)


def _shared_root_case(
    args: argparse.Namespace,
    report: Report,
    label: str,
    layout: CacheLayout,
    blocks: int,
    batch: int,
    goal: str | None,
) -> None:
    procs = 4
    blocks -= blocks % batch  # whole batches: each process writes exactly what is counted
    object_bytes = layout.part_bytes("k") + PAGE
    total = procs * blocks * 2 * object_bytes
    # far below what they write (every process evicts), yet two writes' worth per process
    capacity = max(total // 4, procs * 2 * batch * 2 * object_bytes)
    # RAM-backed: the accounting is measured, not the disk's weather (as the issue measured)
    work = tempfile.mkdtemp(prefix="kvcore-bench-shared-", dir=args.ram_dir)
    samples: dict[str, list[float]] = {"shared": [], "separate": []}
    acked: dict[str, list[float]] = {"shared": [], "separate": []}
    # each root's objects get the same bytes; its own files (journal, ledger) count against
    # its capacity, so each root gets room for them
    caps = {
        "shared": with_own_files(work, capacity, layout),
        "separate": with_own_files(work, capacity // procs, layout),
    }
    try:
        for r in range(args.reps):
            order = ("shared", "separate") if r % 2 == 0 else ("separate", "shared")
            for how in order:
                base = os.path.join(work, f"{how}-{r}")
                roots = [base] * procs if how == "shared" else [f"{base}-{i}" for i in range(procs)]
                cap = caps[how]
                os.sync()
                gbps, fraction = _run_writers(roots, cap, blocks, batch, layout)
                samples[how].append(gbps)
                acked[how].append(fraction)
                for root in set(roots):
                    shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    suffix = "" if label == "typical" else f"_{label}"
    report.figure(f"shared_root_4_writers{suffix}_gbps", samples["shared"], "GB/s")
    report.figure(f"separate_roots_4_writers{suffix}_gbps", samples["separate"], "GB/s")
    report.ratio(f"shared_vs_separate_roots{suffix}", samples["shared"], samples["separate"],
                 goal=goal)  # fmt: skip
    report.notes.setdefault("setup", {})[f"shared_root{suffix}"] = {
        "processes": procs,
        "blocks_per_process": blocks,
        "blocks_per_write": batch,
        "object_bytes": object_bytes,
        "capacity_bytes": capacity,
        "written_bytes": total,
        # blocks acknowledged / blocks written, lowest of the repetitions (1.0: none refused)
        "acknowledged_min": {how: round(min(v), 4) for how, v in acked.items()},
    }


def with_own_files(work: str, objects_bytes: int, layout: CacheLayout) -> int:
    """A capacity that holds ``objects_bytes`` of objects: kv_file counts its own files (the
    journal and ledger) against it, by an amount that depends on the capacity and the file
    system: measured on a store opened beside the roots."""
    probe = tempfile.mkdtemp(prefix="own-files-", dir=work)
    try:
        return capacity_holding(
            lambda capacity: kvcore.open_backend(
                "file", {"root": probe, "capacity_bytes": capacity}, context={"layout": layout}
            ),
            objects_bytes,
        )
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def _run_writers(roots, capacity, blocks, batch, layout) -> tuple[float, float]:
    """Aggregate GB/s of one round of writers (start signal to the last one's end) and the
    fraction of their blocks acknowledged."""
    cmd = [sys.executable, __file__, "--worker"]
    procs = [
        subprocess.Popen(
            [*cmd, root, str(capacity), str(blocks), str(batch), layout.model_dump_json()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for root in roots
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    start = time.time()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    blocks_acked = sum(res["written"] for res in results)
    written = blocks_acked * 2 * (layout.part_bytes("k") + PAGE)
    gbps = written / (max(res["end"] for res in results) - start) / 1e9
    return gbps, blocks_acked / (len(roots) * blocks)


#: the tenant every request names (``--tenant``; workers inherit it): the cost of tenants is
#: this with kv_file's ``tenants`` set (``KVCORE_FILE_TENANTS``) against a run without both
TENANT = os.environ.get("KVCORE_BENCH_TENANT") or None


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        root, capacity, blocks, batch, layout_json = sys.argv[2:7]
        worker(root, int(capacity), int(blocks), int(batch), layout_json)
        return
    ap = argparse.ArgumentParser(description=__doc__)
    add_layout_args(ap, blocks=64)
    ap.add_argument("--query-keys", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--shared-typical-blocks", type=int, default=64,
        help="blocks per writer process, shared root, typical layout",
    )  # fmt: skip
    ap.add_argument(
        "--shared-blocks", type=int, default=512,
        help="blocks per writer process, shared root, 64 KiB parts",
    )  # fmt: skip
    ap.add_argument(
        "--only", default="io,query,shared",
        help="io, query, shared, ceiling (comma-separated)",
    )  # fmt: skip
    ap.add_argument("--dir", default=None, help="disk scratch directory (default: the temp dir)")
    ap.add_argument(
        "--ram-dir",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="RAM-backed scratch: unsynced writes, warm reads, the shared root (default /dev/shm)",
    )
    ap.add_argument(
        "--raw",
        choices=("batch", "native", "python"),
        default="batch",
        help="how the raw contender issues its system calls (default: one native batch for "
        "all objects, as kv_file; native: a native call per object; python: os calls)",
    )
    ap.add_argument(
        "--tenant",
        default=None,
        help="every request names this tenant (with KVCORE_FILE_TENANTS giving kv_file shares: "
        "the cost of tenants, against a run without either)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.tenant:
        global TENANT
        TENANT = os.environ["KVCORE_BENCH_TENANT"] = args.tenant
    if args.shared_blocks < 1 or args.shared_typical_blocks < 1:
        ap.error("--shared-blocks and --shared-typical-blocks must be at least 1")

    report = Report()
    parts = set(args.only.split(","))
    bench = Bench(args)
    try:
        if "io" in parts:
            bench.run(report)
        if "query" in parts:
            bench.queries(report)
        if "ceiling" in parts:
            bench.ceilings(report)
    finally:
        bench.close()
    if "shared" in parts:
        shared_root(args, report)
    report.notes["setup"] = {
        **report.notes.get("setup", {}),
        "blocks": args.blocks,
        "object_bytes": bench.part,
        "reps": args.reps,
        "disk_dir": args.dir or tempfile.gettempdir(),
        "ram_dir": args.ram_dir or tempfile.gettempdir(),
        "cold_reads": "fdatasync + posix_fadvise(DONTNEED) per file; O_DIRECT reads",
        "raw_contender": args.raw,
    }
    emit(report.as_dict(), args.json)


if __name__ == "__main__":
    main()
