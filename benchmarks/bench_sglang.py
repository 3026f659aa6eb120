"""kvcore's kv_file inside SGLang against SGLang's own HiCacheFile, through SGLang's interface.

Both contenders are built by SGLang's ``StorageBackendFactory`` (``dynamic`` + the kvcore
extra config with ``interface_v1``; ``file`` for HiCacheFile) and driven by SGLang's own
``HiCacheController`` storage-thread methods on the same pages of one real SGLang host pool
(``MHATokenToKVPoolHost``, page_first, CPU memory):

- set: ``_page_backup`` of N new pages, in SGLang's batches of 128 (kvcore: ``batch_set_v1``
  from the pool in place; HiCacheFile: ``batch_set`` of ``get_data_page`` copies, the path
  SGLang takes for it);
- get warm: ``_page_transfer`` of those N pages into other host pages, store files in the page
  cache (kvcore: ``batch_get_v1`` in place; HiCacheFile: ``batch_get`` into dummy pages, then
  ``set_from_flat_data_page``);
- get cold: the same after dropping the store files from the page cache (fsync +
  ``posix_fadvise(DONTNEED)`` per file: needs no privilege, spares other users' cache);
- exists: ``batch_exists`` of 10,000 stored keys in batches of 128, as
  ``_storage_hit_query`` calls it (tiny pages: the cost is per key, not per byte).

Repetitions alternate the contenders (the order reverses each time, so of any two, which goes
first flips); every repetition writes fresh keys. Figures are the median and range (min, max)
over ``--reps``; ratios are HiCacheFile's time over kvcore's in the same repetition (paired;
> 1: kvcore is faster), then their median and range. kv_file runs with its defaults:
crash-safe (temp file + rename) and checksummed (xxh3-128 verified on every read), no fsync,
as HiCacheFile (temp file + rename, no checksum, no fsync).

Run it with the SGLang test venv (``bash integrations/sglang/scripts/test.sh`` creates it):

    integrations/sglang/.venv/bin/python benchmarks/bench_sglang.py --json
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import Report, emit

try:
    from kvcore_sglang.testing import (
        controller_for,
        create_storage,
        extra_config,
        fill_random,
        mha_host_pool,
        prepare_cpu_sglang,
        storage_config,
    )
except ImportError as exc:  # run with the wrong interpreter
    sys.exit(
        f"bench_sglang needs SGLang and kvcore-sglang ({exc}); run it with "
        "integrations/sglang/.venv/bin/python (bash integrations/sglang/scripts/test.sh makes it)"
    )

EXISTS_KEYS = 10_000


def drop_cached_pages(root: str) -> int:
    """Drop the page-cache pages of every file under ``root``; the number of files."""
    os.sync()  # dirty pages cannot be dropped
    count = 0
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count


class Contender:
    """One storage, SGLang's controller driving it, and where its files are."""

    def __init__(
        self,
        name: str,
        storage: Any,
        pool: Any,
        root: str,
        zero_copy: bool,
        storage_only: bool = False,
    ) -> None:
        self.name = name
        self.storage_only = storage_only
        self.storage = storage
        self.pool = pool
        self.root = root
        self.ctrl = controller_for(storage, pool, zero_copy=zero_copy)
        self.times: dict[str, list[float]] = {"set": [], "get_warm": [], "get_cold": []}
        self.exists_s: list[float] = []
        self.tiny: Any = None  # the exists store

    def timed(self, what: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.times[what].append(time.perf_counter() - t0)
        return out


def page_slots(pool: Any, first: int, n: int) -> Any:
    import torch

    return torch.arange(first * pool.page_size, (first + n) * pool.page_size, dtype=torch.int64)


def one_round(c: Contender, tokens: list[int], pages: int) -> None:
    from sglang.srt.managers.cache_controller import PrefetchOperation, StorageOperation
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    pool = c.pool
    keys = get_storage_hash_str(tokens, None, page_size=pool.page_size)
    if c.storage_only:
        storage_calls_round(c, keys, pages)
        return
    backup = StorageOperation(page_slots(pool, 0, pages), tokens, hash_value=keys)
    c.timed("set", lambda: c.ctrl._page_backup(backup))
    if backup.completed_tokens != len(tokens):
        raise RuntimeError(f"{c.name}: stored {backup.completed_tokens} of {len(tokens)} tokens")

    def get() -> None:
        prefetch = PrefetchOperation("bench", tokens)
        prefetch.hash_value = keys
        prefetch.host_indices = page_slots(pool, pages, pages)
        done = c.ctrl._page_transfer(prefetch)
        c.ctrl.prefetch_sync_queue.queue.clear()
        if done != pages:
            raise RuntimeError(f"{c.name}: read {done} of {pages} pages")

    c.timed("get_warm", get)
    drop_cached_pages(c.root)
    c.timed("get_cold", get)


def storage_calls_round(c: Contender, keys: list[str], pages: int) -> None:
    """HiCacheFile's own calls alone, in SGLang's batches: flat pages copied out of the pool
    beforehand, targets allocated beforehand, nothing copied back into the pool."""
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

    pool = c.pool
    flat = [pool.get_data_page(i * pool.page_size).contiguous() for i in range(pages)]
    targets = [pool.get_dummy_flat_data_page() for _ in range(pages)]
    batches = range(0, pages, STORAGE_BATCH_SIZE)

    def put() -> None:
        for i in batches:
            if not c.storage.batch_set(
                keys[i : i + STORAGE_BATCH_SIZE], flat[i : i + STORAGE_BATCH_SIZE]
            ):
                raise RuntimeError(f"{c.name}: batch_set failed")

    def get() -> None:
        for i in batches:
            got = c.storage.batch_get(
                keys[i : i + STORAGE_BATCH_SIZE], targets[i : i + STORAGE_BATCH_SIZE]
            )
            if any(t is None for t in got):
                raise RuntimeError(f"{c.name}: batch_get missed")

    c.timed("set", put)
    c.timed("get_warm", get)
    drop_cached_pages(c.root)
    c.timed("get_cold", get)


def exists_round(c: Contender, keys: list[str]) -> None:
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

    t0 = time.perf_counter()
    found = 0
    for start in range(0, len(keys), STORAGE_BATCH_SIZE):
        found += c.tiny.batch_exists(keys[start : start + STORAGE_BATCH_SIZE])
    c.exists_s.append(time.perf_counter() - t0)
    if found != len(keys):
        raise RuntimeError(f"{c.name}: {found} of {len(keys)} keys found")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=8, help="KV heads on this rank")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64, help="tokens per SGLang page")
    ap.add_argument("--pages", type=int, default=64, help="pages per set/get")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where both stores live (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    prepare_cpu_sglang()
    import logging

    logging.disable(logging.WARNING)  # HiCacheFile logs every miss; kvcore logs nothing here

    base = tempfile.mkdtemp(prefix="bench-sglang-", dir=args.dir)
    try:
        pool = mha_host_pool(
            "page_first",
            layers=args.layers,
            heads=args.heads,
            head_dim=args.head_dim,
            page_size=args.page_size,
            pages=2 * args.pages,
        )
        fill_random(pool, 1)
        tiny = mha_host_pool("page_first", layers=1, heads=1, head_dim=64, page_size=16, pages=1)
        fill_random(tiny, 2)
        page_nbytes = pool.get_data_page(0).numel() * pool.dtype.itemsize
        capacity = 4 * page_nbytes * args.pages * (args.reps + 1) + (1 << 30)

        contenders = []
        for name in ("kvcore_file", "hicache_file"):
            root = os.path.join(base, name)
            if name == "kvcore_file":

                def make(p: Any, namespace: str, root: str = root) -> Any:
                    config = {"root": root, "capacity_bytes": capacity}
                    extra = extra_config("file", config, namespace=namespace)
                    return create_storage("dynamic", storage_config(extra), p)

            else:

                def make(p: Any, namespace: str, root: str = root) -> Any:
                    extra = {"file_storage_path": os.path.join(root, namespace)}
                    return create_storage("file", storage_config(extra), p)

            c = Contender(name, make(pool, "bench"), pool, root, zero_copy=name == "kvcore_file")
            c.tiny = make(tiny, "exists")  # 10,000 one-page entries of 4 KiB
            contenders.append(c)
        # HiCacheFile's storage calls without SGLang's page copies around them: what its
        # store costs by itself (reported, not a goal: SGLang cannot call it that way)
        calls_only = Contender(
            "hicache_file_calls_only",
            contenders[1].storage,
            pool,
            contenders[1].root,
            zero_copy=False,
            storage_only=True,
        )

        # the exists set: the same 10,000 keys stored in both (untimed)
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        exist_keys = get_storage_hash_str(list(range(EXISTS_KEYS * 16)), None, page_size=16)
        tiny_page = tiny.get_data_page(0).contiguous()
        for c in contenders:
            for start in range(0, EXISTS_KEYS, 128):
                chunk = exist_keys[start : start + 128]
                if c.name == "kvcore_file":
                    ok = all(c.tiny.batch_set_v1(chunk, page_slots(tiny, 0, 1).repeat(len(chunk))))
                else:
                    ok = c.tiny.batch_set(chunk, [tiny_page] * len(chunk))
                if not ok:
                    raise RuntimeError(f"{c.name}: could not store the exists set")

        pages_tokens = args.pages * args.page_size
        # one untimed round each: first file creations, thread pools, lazy imports
        rotation = [*contenders, calls_only]
        for k, c in enumerate(rotation):
            one_round(c, [(k + 1) * 10**6 + i for i in range(pages_tokens)], args.pages)
            for times in c.times.values():
                times.clear()
        for rep in range(args.reps):
            # reversed every other repetition: of any two contenders, each goes first in turn
            # (a rotation of three would not alternate every pair); every round writes keys
            # never written before
            order = rotation if rep % 2 == 0 else rotation[::-1]
            for c in order:
                tokens = [
                    (rep + 1) * 10**8 + rotation.index(c) * 10**7 + i for i in range(pages_tokens)
                ]
                one_round(c, tokens, args.pages)
            for c in order:
                if not c.storage_only:
                    exists_round(c, exist_keys)

        gb = page_nbytes * args.pages / 1e9
        report = Report()
        for c in rotation:
            for what, values in c.times.items():
                report.figure(f"{c.name}_{what}_gbps", [gb / t for t in values], "GB/s")
            if c.exists_s:
                report.figure(f"{c.name}_exists_10k_ms", [t * 1e3 for t in c.exists_s], "ms")
        timed = {c.name: {**c.times, "exists": c.exists_s} for c in rotation}
        kv = timed["kvcore_file"]
        goals = {"set": ">= 1.2", "get_warm": ">= 1.0", "get_cold": ">= 1.2"}
        # HiCacheFile's seconds over kvcore's, repetition by repetition: > 1, kvcore is faster
        for what in ("set", "get_warm", "get_cold", "exists"):
            report.ratio(
                f"{what}_vs_hicache_file",
                timed["hicache_file"][what],
                kv[what],
                goal=goals.get(what),
            )
        for what in ("set", "get_warm", "get_cold"):
            report.ratio(
                f"{what}_vs_hicache_file_calls_only",
                timed["hicache_file_calls_only"][what],
                kv[what],
            )
        kv_stats = contenders[0].storage.kvcore_stats()
        report.notes["setup"] = {
            "page_mib": round(page_nbytes / 2**20, 3),
            "pages_per_call": args.pages,
            "bytes_per_call_mib": round(page_nbytes * args.pages / 2**20, 1),
            "reps": args.reps,
            "cold_read_method": "fsync + posix_fadvise(DONTNEED) per store file",
            "kv_file": "defaults: fsync none, checksummed, temp file + rename",
        }
        report.notes["kvcore_counters"] = {
            k: kv_stats[k]
            for k in (
                "kv.backend_direct_reads",
                "kv.backend_read_hits",
                "kv.backend_write_stored",
            )
            if k in kv_stats
        }
        for c in contenders:
            for storage in (c.storage, c.tiny):
                if hasattr(storage, "close"):
                    storage.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    emit(report.as_dict(), args.json)


if __name__ == "__main__":
    main()
