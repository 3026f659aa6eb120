"""GPU check and benchmark of the TransferManager on CUDA-resident caches through kv_file.

Runs where torch sees a CUDA device and kvcore was built with its CUDA library
(``KVCORE_CUDA=1``: ``kvcore/_swap_cuda.so``). Paddle is not needed: the cache tensors are torch
tensors, which kvcore accepts wherever it takes a device cache.

Checks (each byte-exact against the source tensors):
- write-back then read into other device blocks, for bfloat16 and block-wise fp8 (1-byte
  elements plus scales), random block ids, a stored prefix skipped on the second write;
- a read whose deadline expires mid-task: the blocks the answer lists are exact, and every
  block it does not list still holds its sentinel bytes after the worker has finished (no late
  scatter into a block the engine may already have reused);
- a write-back whose deadline expires mid-task: what it acknowledged reads back exact.

Benchmark (``--bench``), median of repetitions, contenders alternated within each repetition:
cudaMemcpy between pinned host memory and the device (the baseline), the swap ops' gather and
scatter into pinned staging, the backend alone (kv_file under ``--root``, RAM-backed by default),
and the manager's write-back and read. One JSON object on stdout.

    python tests/cuda/run_transfer_gpu.py [--bench] [--root /dev/shm]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

import kvcore
from kvcore import ops
from kvcore.cuda_lib import require_cuda
from kvcore.transfer import DeviceCache, TransferManager

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins" / "kv_file"))
from kv_file import FileBackend  # noqa: E402  (run from a checkout: no install needed)

GB = 1e9
SENTINEL = 0xA5

_TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


def _kv_dtype(layout: kvcore.CacheLayout) -> torch.dtype:
    if layout.dtype.has_scales:
        return getattr(torch, "float8_e4m3fn", torch.uint8)
    return _TORCH_DTYPE[layout.dtype.value]


_SCALE_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_cache(layout: kvcore.CacheLayout, gen: torch.Generator | None) -> DeviceCache:
    """Per-layer CUDA tensors; random bytes from ``gen``, or the sentinel byte if None."""
    parts: dict[str, list[torch.Tensor]] = {}
    for part in layout.parts:
        if part in ("k", "v"):
            shape, dtype = layout.kv_shape, _kv_dtype(layout)
        else:
            shape, dtype = layout.scale_shape, _SCALE_DTYPE[layout.scale_dtype]
        tensors = []
        for layer in range(layout.total_layers):
            n = layout.layer_num_blocks(layer)
            t = torch.empty((n, *shape[1:]), dtype=dtype, device="cuda")
            raw = t.view(torch.uint8)
            if gen is None:
                raw.fill_(SENTINEL)
            else:
                raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
            tensors.append(t)
        parts[part] = tensors
    return DeviceCache(layout, parts["k"], parts["v"], parts.get("k_scale"), parts.get("v_scale"))


def blocks_equal(a: DeviceCache, a_ids: list[int], b: DeviceCache, b_ids: list[int]) -> bool:
    if not a_ids:
        return True
    ia = torch.tensor(a_ids, device="cuda")
    ib = torch.tensor(b_ids, device="cuda")
    return all(
        torch.equal(x.view(torch.uint8)[ia], y.view(torch.uint8)[ib])
        for part in a.layout.parts
        for x, y in zip(a.tensors[part], b.tensors[part], strict=True)
    )


def blocks_are_sentinel(c: DeviceCache, ids: list[int]) -> bool:
    if not ids:
        return True
    idx = torch.tensor(ids, device="cuda")
    return all(
        bool((t.view(torch.uint8)[idx] == SENTINEL).all())
        for part in c.layout.parts
        for t in c.tensors[part]
    )


def keys_for(layout: kvcore.CacheLayout, n: int) -> list[str]:
    tokens = torch.randint(0, 100_000, (n * layout.block_size,)).tolist()
    return kvcore.block_hashes(
        tokens, layout.block_size, kvcore.KeyScope(namespace=uuid.uuid4().hex)
    )


def open_file(root: str, layout: kvcore.CacheLayout) -> kvcore.Backend:
    return kvcore.open_backend(
        FileBackend,
        {"root": root, "capacity_bytes": 64 * 2**30, "rescan_interval_s": 0},
        context={"layout": layout},
        strict=True,
    )


def manager(layout: kvcore.CacheLayout, cache: DeviceCache, backend: Any, n: int, **kw: Any):
    conf = {"layout": layout, "max_model_len": n * layout.block_size, "default_timeout_s": 600}
    return TransferManager({**conf, **kw}, cache, backend)


# --------------------------------------------------------------------------- checks


def check_round_trip(root: str, dtype: str, scale_dtype: str = "float32") -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    layout = kvcore.CacheLayout(
        num_layers=5, num_heads=4, block_size=16, head_dim=64, dtype=dtype, num_blocks=96,
        num_extra_layers=1, extra_num_blocks=80, scale_dtype=scale_dtype,
    )  # fmt: skip
    src, dst = make_cache(layout, gen), make_cache(layout, None)
    n = 40
    perm = torch.randperm(80, generator=gen).tolist()
    src_ids, dst_ids = perm[:n], perm[n : 2 * n]
    keys = keys_for(layout, n)
    with open_file(root, layout) as backend:
        tm = manager(layout, src, backend, n, pipeline_blocks=7)
        first = tm.write_back(
            {"task_id": "w1", "keys": keys[:13], "device_block_ids": src_ids[:13]}
        ).result()
        second = tm.write_back(
            {"task_id": "w2", "keys": keys, "device_block_ids": src_ids}
        ).result()
        assert first.ok and first.num_blocks == 13, first
        assert second.ok and second.skipped_blocks == 13 and second.num_blocks == n - 13, second
        tm.restore_caches(dst)
        r = tm.read({"task_id": "r", "keys": keys, "device_block_ids": dst_ids}).result()
        assert r.ok and r.num_blocks == n, r
        torch.cuda.synchronize()
        assert blocks_equal(src, src_ids, dst, dst_ids), f"{dtype}: restored bytes differ"
        untouched = [b for b in range(80) if b not in dst_ids]
        assert blocks_are_sentinel(dst, untouched), f"{dtype}: a block outside the read changed"
        tm.close()
    return {"dtype": dtype, "scale_dtype": scale_dtype, "blocks": n, "storage_io": tm.storage_io}


def check_deadline_mid_read(root: str) -> dict[str, Any]:
    """A read answered at its deadline leaves every unlisted block untouched for good."""
    layout = kvcore.CacheLayout(
        num_layers=28, num_heads=8, block_size=64, head_dim=128, dtype="bfloat16", num_blocks=256
    )
    gen = torch.Generator().manual_seed(5)
    src = make_cache(layout, gen)
    n = 120
    ids = list(range(n))
    keys = keys_for(layout, n)
    with open_file(root, layout) as backend:
        tm = manager(layout, src, backend, n, pipeline_blocks=8, read_workers=1)
        w = tm.write_back({"task_id": "w", "keys": keys, "device_block_ids": ids}).result()
        assert w.ok and w.num_blocks == n, w
        full_s = []
        for _ in range(2):
            dst = make_cache(layout, None)
            tm.restore_caches(dst)
            r = tm.read({"task_id": "full", "keys": keys, "device_block_ids": ids}).result()
            assert r.num_blocks == n, r
            full_s.append(r.timings_s["total"])
        attempts = []
        for frac in (0.5, 0.3, 0.7, 0.15):
            dst = make_cache(layout, None)
            tm.restore_caches(dst)
            timeout = max(0.002, frac * min(full_s))
            r = tm.read(
                {"task_id": "cut", "keys": keys, "device_block_ids": ids, "timeout_s": timeout}
            ).result()
            listed = list(r.block_ids)
            time.sleep(2 * max(full_s) + 0.5)  # let the worker run to its end
            torch.cuda.synchronize()
            unlisted = [b for b in ids if b not in listed]
            assert listed == ids[: len(listed)], f"answered blocks are not a leading run: {r}"
            assert blocks_equal(src, listed, dst, listed), "an answered block is wrong"
            assert blocks_are_sentinel(dst, unlisted), "a block was scattered after the answer"
            attempts.append(
                {
                    "timeout_s": round(timeout, 4),
                    "answered": len(listed),
                    "missed": r.deadline_missed,
                }
            )
            if r.deadline_missed and 0 < len(listed) < n:
                break
        tm.close()
    mid = any(a["missed"] and 0 < a["answered"] < n for a in attempts)
    return {"full_read_s": [round(s, 4) for s in full_s], "attempts": attempts, "mid_task": mid}


def check_deadline_mid_write(root: str) -> dict[str, Any]:
    layout = kvcore.CacheLayout(
        num_layers=28, num_heads=8, block_size=64, head_dim=128, dtype="bfloat16", num_blocks=128
    )
    gen = torch.Generator().manual_seed(9)
    src = make_cache(layout, gen)
    n = 100
    ids = list(range(n))
    keys = keys_for(layout, n)
    with open_file(root, layout) as backend:
        tm = manager(layout, src, backend, n, pipeline_blocks=8, write_workers=1)
        w = tm.write_back(
            {"task_id": "w", "keys": keys, "device_block_ids": ids, "timeout_s": 0.05}
        ).result()
        time.sleep(3)
        done = w.num_blocks
        stored = backend.query(backend.request("q", keys, timeout_s=10))
        assert stored >= done, f"acknowledged {done} blocks but only {stored} are stored"
        dst = make_cache(layout, None)
        tm.restore_caches(dst)
        r = tm.read({"task_id": "r", "keys": keys[:done], "device_block_ids": ids[:done]}).result()
        torch.cuda.synchronize()
        assert r.num_blocks == done, r
        assert blocks_equal(src, ids[:done], dst, ids[:done]), "acknowledged blocks differ"
        tm.close()
    return {"acknowledged": done, "missed": w.deadline_missed, "stored_after": stored}


# --------------------------------------------------------------------------- benchmark


class _Memcpy:
    """cudaMemcpy through kvcore's own CUDA library (the same runtime the swap ops use)."""

    def __init__(self) -> None:
        lib = require_cuda().lib
        fn = lib.kvc_cuda_memcpy
        fn.argtypes = [
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_int64,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        fn.restype = ctypes.c_int
        self.fn = fn

    def __call__(self, dst: int, src: int, nbytes: int) -> None:
        err = ctypes.create_string_buffer(256)
        if self.fn(dst, src, nbytes, err, 256) != 0:
            raise RuntimeError(err.value.decode())


def bench(root: str, blocks: int, repeats: int) -> dict[str, Any]:
    layout = kvcore.CacheLayout(
        num_layers=28, num_heads=8, block_size=64, head_dim=128, dtype="bfloat16",
        num_blocks=2 * blocks,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    src, dst = make_cache(layout, gen), make_cache(layout, None)
    nbytes = blocks * layout.block_bytes
    src_ids = list(range(blocks))
    dst_ids = list(range(blocks, 2 * blocks))
    memcpy = _Memcpy()
    pinned = ops.HostBuffer(nbytes, pinned=True)
    pinned.array.fill(0)
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    staging = [ops.HostBuffer(blocks * layout.part_bytes(p), pinned=True) for p in layout.parts]
    for r in staging:
        r.array.fill(0)
    sizes = tuple(layout.part_bytes(p) for p in layout.parts)
    host = kvcore.HostBuffers(
        ptrs=tuple(
            tuple(r.ptr + i * s for r, s in zip(staging, sizes, strict=True)) for i in range(blocks)
        ),
        nbytes=sizes,
    )
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> Any:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    def gather() -> None:
        for part, region in zip(layout.parts, staging, strict=True):
            ops.swap_cache_layout(
                src.tensors[part], region, src.block_shape(part), src_ids, list(range(blocks)), 0, 0
            )

    def scatter() -> None:
        for part, region in zip(layout.parts, staging, strict=True):
            ops.swap_cache_layout(
                dst.tensors[part], region, dst.block_shape(part), dst_ids, list(range(blocks)), 0, 1
            )

    # (span, depth) of the staged pipeline; the budget is lifted so each runs as configured
    spans = {"s8d2": (8, 2), "s16d2": (16, 2), "s32d2": (32, 2), "s16d3": (16, 3), "s8d4": (8, 4)}
    stage_s: dict[str, list[float]] = {}
    # a second staging set, so the two read stages can run at once by hand (what perfect
    # overlap of "backend read" and "scatter" reaches on this host: they share its memory)
    staging2 = [ops.HostBuffer(blocks * layout.part_bytes(p), pinned=True) for p in layout.parts]
    for r in staging2:
        r.array.fill(0)
    host2 = kvcore.HostBuffers(
        ptrs=tuple(
            tuple(r.ptr + i * s for r, s in zip(staging2, sizes, strict=True))
            for i in range(blocks)
        ),
        nbytes=sizes,
    )

    def both_read_stages(backend: Any, keys: list[str]) -> None:
        reader = threading.Thread(
            target=backend.read, args=(backend.request("bp", keys, timeout_s=600, host=host2),)
        )
        reader.start()
        scatter()
        reader.join()

    with open_file(root, layout) as backend:
        tms = {
            span: manager(
                layout,
                src,
                backend,
                blocks,
                read_workers=1,
                write_workers=1,
                staging_buffers=1,
                pipeline_blocks=sd[0],
                pipeline_depth=sd[1],
                staging_budget_bytes=2**36,
            )
            for span, sd in spans.items()
        }
        for rep in range(repeats + 1):  # the first repetition warms up and is dropped
            keys2 = keys_for(layout, blocks)
            timed("memcpy_d2h", lambda: memcpy(pinned.ptr, flat_dev.data_ptr(), nbytes))
            timed("memcpy_h2d", lambda: memcpy(flat_dev.data_ptr(), pinned.ptr, nbytes))
            timed("gather", gather)
            timed("scatter", scatter)
            timed(
                "backend_write",
                lambda k=keys2: backend.write(backend.request("bw", k, timeout_s=600, host=host)),
            )
            got = timed(
                "backend_read",
                lambda k=keys2: backend.read(backend.request("br", k, timeout_s=600, host=host)),
            )
            assert got == blocks
            timed("both_read_stages", lambda k=keys2: both_read_stages(backend, k))
            for span, tm in tms.items():
                keys = keys_for(layout, blocks)
                tm.restore_caches(src)
                w = timed(
                    f"tm_write_{span}",
                    lambda k=keys, tm=tm: tm.write_back(
                        {"task_id": "w", "keys": k, "device_block_ids": src_ids}
                    ).result(),
                )
                assert w.ok and w.num_blocks == blocks, w
                tm.restore_caches(dst)
                r = timed(
                    f"tm_read_{span}",
                    lambda k=keys, tm=tm: tm.read(
                        {"task_id": "r", "keys": k, "device_block_ids": dst_ids}
                    ).result(),
                )
                assert r.ok and r.num_blocks == blocks, r
                if rep:
                    for res, op in ((w, "write"), (r, "read")):
                        for stage, sec in res.timings_s.items():
                            stage_s.setdefault(f"{op}_{span}_{stage}", []).append(sec)
            if rep == 0:
                times.clear()
        torch.cuda.synchronize()
        verified = blocks_equal(src, src_ids, dst, dst_ids)
        for tm in tms.values():
            tm.close()

    def gbps(name: str) -> float:
        return round(nbytes / statistics.median(times[name]) / GB, 3)

    f: dict[str, float] = {
        "bytes_per_op": nbytes,
        "cuda_memcpy_d2h_pinned_gbps": gbps("memcpy_d2h"),
        "cuda_memcpy_h2d_pinned_gbps": gbps("memcpy_h2d"),
        "swap_layout_gather_gbps": gbps("gather"),
        "swap_layout_scatter_gbps": gbps("scatter"),
        "backend_write_gbps": gbps("backend_write"),
        "backend_read_gbps": gbps("backend_read"),
        "read_stages_overlapped_by_hand_gbps": gbps("both_read_stages"),
    }
    for span in spans:
        f[f"manager_write_back_span{span}_gbps"] = gbps(f"tm_write_{span}")
        f[f"manager_read_span{span}_gbps"] = gbps(f"tm_read_{span}")
    serial_write = 1 / (1 / f["backend_write_gbps"] + 1 / f["swap_layout_gather_gbps"])
    serial_read = 1 / (1 / f["backend_read_gbps"] + 1 / f["swap_layout_scatter_gbps"])
    f["serial_write_back_gbps"] = round(serial_write, 3)
    f["serial_read_gbps"] = round(serial_read, 3)
    write_slower = min(f["backend_write_gbps"], f["swap_layout_gather_gbps"])
    read_slower = min(f["backend_read_gbps"], f["swap_layout_scatter_gbps"])

    def ratio(a: float, b: float) -> float:
        return round(a / b, 3)

    ratios = {
        "swap_layout_gather_vs_memcpy": ratio(
            f["swap_layout_gather_gbps"], f["cuda_memcpy_d2h_pinned_gbps"]
        ),
        "swap_layout_scatter_vs_memcpy": ratio(
            f["swap_layout_scatter_gbps"], f["cuda_memcpy_h2d_pinned_gbps"]
        ),
    }
    for span in spans:
        w, r = f[f"manager_write_back_span{span}_gbps"], f[f"manager_read_span{span}_gbps"]
        ratios[f"manager_write_back_span{span}_vs_slower_stage"] = ratio(w, write_slower)
        ratios[f"manager_read_span{span}_vs_slower_stage"] = ratio(r, read_slower)
        ratios[f"manager_write_back_span{span}_vs_serial"] = ratio(w, serial_write)
        ratios[f"manager_read_span{span}_vs_serial"] = ratio(r, serial_read)
        ratios[f"manager_read_span{span}_vs_stages_overlapped_by_hand"] = ratio(
            r, f["read_stages_overlapped_by_hand_gbps"]
        )
    return {
        "figures": f,
        "ratios": ratios,
        "goals": {
            "swap_layout_gather_vs_memcpy": ">= 0.85",
            "swap_layout_scatter_vs_memcpy": ">= 0.85",
            "manager_write_back_spans16d2_vs_slower_stage": ">= 0.7",
            "manager_read_spans16d2_vs_slower_stage": ">= 0.7",
        },
        "stage_medians_ms": {
            k: round(statistics.median(v) * 1e3, 2) for k, v in sorted(stage_s.items())
        },
        "bytes_verified": verified,
        "repeats": repeats,
    }


def bench_host_resident(root: str, blocks: int, repeats: int) -> dict[str, Any]:
    """The host-resident path on this host's CPUs: a torch CPU cache, kv_file in ``root``; the
    manager's write-back and warm read against the backend alone on the same bytes."""
    layout = kvcore.CacheLayout(
        num_layers=28, num_heads=8, block_size=64, head_dim=128, dtype="bfloat16",
        num_blocks=2 * blocks,
    )  # fmt: skip
    src = DeviceCache(
        layout,
        *[[torch.randint(0, 2**15, layout.kv_shape, dtype=torch.int16).view(torch.bfloat16)
           for _ in range(layout.total_layers)] for _part in range(2)],
    )  # fmt: skip
    dst = DeviceCache(
        layout,
        *[[torch.zeros(layout.kv_shape, dtype=torch.bfloat16) for _ in range(layout.total_layers)]
          for _part in range(2)],
    )  # fmt: skip
    nbytes = blocks * layout.block_bytes
    sizes = tuple(layout.part_bytes(p) for p in layout.parts)
    regions = [ops.HostBuffer(blocks * n, pinned=False) for n in sizes]
    for r in regions:
        r.array.fill(1)
    host = kvcore.HostBuffers(
        ptrs=tuple(
            tuple(r.ptr + i * n for r, n in zip(regions, sizes, strict=True)) for i in range(blocks)
        ),
        nbytes=sizes,
    )
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    with open_file(root, layout) as backend:
        tm = manager(layout, src, backend, blocks, storage_io="host_resident")
        for rep in range(repeats + 1):
            k1, k2 = keys_for(layout, blocks), keys_for(layout, blocks)
            timed("backend_write", lambda k=k2: backend.write(backend.request("w", k, host=host)))
            tm.restore_caches(src)
            w = timed("resident_write", lambda k=k1: tm.write_back(
                {"task_id": "w", "keys": k, "device_block_ids": list(range(blocks))}).result())  # fmt: skip
            assert w.num_blocks == blocks, w
            timed("backend_read", lambda k=k2: backend.read(backend.request("r", k, host=host)))
            tm.restore_caches(dst)
            r = timed("resident_read", lambda k=k1: tm.read(
                {"task_id": "r", "keys": k, "device_block_ids": list(range(blocks, 2 * blocks))}
            ).result())  # fmt: skip
            assert r.num_blocks == blocks, r
            if rep == 0:
                times.clear()
        verified = all(
            torch.equal(a[:blocks].view(torch.int16), b[blocks:].view(torch.int16))  # NaN bits
            for part in layout.parts
            for a, b in zip(src.tensors[part], dst.tensors[part], strict=True)
        )
        tm.close()
    g = {k: round(nbytes / statistics.median(v) / GB, 3) for k, v in times.items()}
    return {
        "figures": {f"{k}_gbps": v for k, v in g.items()},
        "ratios": {
            "host_resident_read_warm_vs_backend": round(g["resident_read"] / g["backend_read"], 3),
            "host_resident_write_back_vs_backend": round(
                g["resident_write"] / g["backend_write"], 3
            ),
        },
        "bytes_verified": verified,
        "cpus": os.cpu_count(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", default="/dev/shm", help="where the kv_file store lives")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not ops.cuda_available():
        print("no usable CUDA device or kvcore CUDA library", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "checks": {}}
    root = tempfile.mkdtemp(prefix="kvcore-gpu-", dir=args.root)
    try:
        for dtype, scales in (
            ("bfloat16", "float32"),
            ("float16", "float32"),
            ("block_wise_fp8", "float32"),
            ("block_wise_fp8", "bfloat16"),
        ):
            name = f"round_trip_{dtype}" + (f"_{scales}_scales" if dtype.endswith("fp8") else "")
            report["checks"][name] = check_round_trip(root, dtype, scales)
        report["checks"]["deadline_mid_read"] = check_deadline_mid_read(root)
        report["checks"]["deadline_mid_write"] = check_deadline_mid_write(root)
        if args.bench:
            report.update(bench(root, args.blocks, args.repeats))
            report["host_resident_on_this_host"] = bench_host_resident(
                root, args.blocks, args.repeats
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
