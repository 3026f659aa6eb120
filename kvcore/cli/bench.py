"""``kvcore bench``: write, read and query throughput through kvcore beside raw baselines.

Baselines measured in the same run: memcpy of the same bytes, and the backend's own raw
figures when it provides them (``kvcore_raw_baseline``: raw disk I/O for ``file``, the raw
client for ``mooncake``). Each figure is the median of ``--repeats`` repetitions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

import numpy as np

from kvcore.backend import Backend
from kvcore.keys import KeyScope, block_hashes
from kvcore.ops import HostBuffer
from kvcore.registry import open_backend
from kvcore.requests import HostBuffers
from kvcore.schemas import BackendContext, CacheLayout

#: the typical layout of the issues: 28 layers x 8 heads x 64 tokens x 128 dim, bfloat16
TYPICAL = CacheLayout(num_layers=28, num_heads=8, block_size=64, head_dim=128, dtype="bfloat16")
GIB = 1024**3


def _staging(layout: CacheLayout, n: int) -> tuple[list[HostBuffer], HostBuffers]:
    sizes = tuple(layout.part_bytes(p) for p in layout.parts)
    regions = [HostBuffer(n * s) for s in sizes]
    for r in regions:  # fault the pages in before anything is timed
        r.array.fill(0)
    host = HostBuffers(
        ptrs=tuple(
            tuple(r.ptr + i * s for r, s in zip(regions, sizes, strict=True)) for i in range(n)
        ),
        nbytes=sizes,
    )
    return regions, host


def measure(backend: Backend, layout: CacheLayout, blocks: int, repeats: int) -> dict[str, Any]:
    src, src_host = _staging(layout, blocks)
    dst, dst_host = _staging(layout, blocks)
    rng = np.random.default_rng(0)
    for r in src:
        r.array[:] = rng.integers(0, 256, r.nbytes, dtype=np.uint8)
    nbytes = sum(r.nbytes for r in src)
    for r in (*src, *dst):
        backend.register_buffer(r.ptr, r.nbytes)
    writes, reads, queries, copies, verified = [], [], [], [], True
    for rep in range(repeats):
        tokens = rng.integers(0, 100_000, blocks * layout.block_size).tolist()
        keys = block_hashes(
            tokens, layout.block_size, KeyScope(namespace=f"bench-{uuid.uuid4().hex}")
        )

        def req(
            host: HostBuffers | None = None,
            rep: int = rep,
            keys: list[str] = keys,
            tokens: list[int] = tokens,
        ) -> Any:
            return backend.request(f"bench-{rep}", keys, token_ids=tokens, timeout_s=600, host=host)

        t0 = time.perf_counter()
        wrote = backend.write(req(src_host))
        t1 = time.perf_counter()
        found = backend.query(req())
        t2 = time.perf_counter()
        for r in dst:
            r.array[:1] = 0  # make sure the read really lands
        got = backend.read(req(dst_host))
        t3 = time.perf_counter()
        if (wrote, found, got) != (blocks, blocks, blocks):
            raise SystemExit(
                f"kvcore bench: backend stored {wrote}, found {found}, read {got} "
                f"of {blocks} blocks; see `kvcore -v bench`"
            )
        verified &= all(np.array_equal(a.array, b.array) for a, b in zip(src, dst, strict=True))
        for a, b in zip(src, dst, strict=True):
            c0 = time.perf_counter()
            np.copyto(b.array, a.array)
            copies.append(time.perf_counter() - c0)
        writes.append(t1 - t0)
        queries.append(t2 - t1)
        reads.append(t3 - t2)
    copy_s = statistics.median(copies) * len(src)
    raws = [
        backend.raw_baseline(src[0].ptr, src[0].nbytes, layout.part_bytes("k"))
        for _ in range(repeats)
    ]
    raw = {
        k: statistics.median(r[k] for r in raws if k in r)
        for k in ("write_gbps", "read_gbps")
        if any(k in r for r in raws)
    }
    for r in (*src, *dst):
        backend.unregister_buffer(r.ptr)
    write_gbps = nbytes / GIB / statistics.median(writes)
    read_gbps = nbytes / GIB / statistics.median(reads)
    figures: dict[str, float] = {
        "bytes_per_op": nbytes,
        "blocks": blocks,
        "write_gbps": write_gbps,
        "read_gbps": read_gbps,
        "query_ms": statistics.median(queries) * 1e3,
        "memcpy_gbps": nbytes / GIB / copy_s,
    }
    ratios = {
        "write_vs_memcpy": write_gbps / figures["memcpy_gbps"],
        "read_vs_memcpy": read_gbps / figures["memcpy_gbps"],
    }
    goals = {}
    if "write_gbps" in raw:
        figures["raw_write_gbps"] = raw["write_gbps"]
        ratios["write_vs_raw"] = write_gbps / raw["write_gbps"]
        goals["write_vs_raw"] = ">= 0.9"
    if "read_gbps" in raw:
        figures["raw_read_gbps"] = raw["read_gbps"]
        ratios["read_vs_raw"] = read_gbps / raw["read_gbps"]
        goals["read_vs_raw"] = ">= 0.9"
    return {
        "backend": backend.name,
        "figures": {k: round(v, 4) for k, v in figures.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "goals": goals,
        "verified": verified,
        "repeats": repeats,
    }


def run(args: argparse.Namespace) -> int:
    from kvcore.cli import load_config_arg

    if args.blocks < 1 or args.repeats < 1:
        raise SystemExit("kvcore bench: --blocks and --repeats must be >= 1")
    config = load_config_arg(args.config)
    context = BackendContext(layout=TYPICAL, namespace="kvcore-bench")
    with open_backend(args.backend, config, context=context) as backend:
        out = measure(backend, TYPICAL, args.blocks, args.repeats)
    if args.json:
        print(json.dumps(out))
        return 0 if out["verified"] else 2
    f, r = out["figures"], out["ratios"]
    print(
        f"kvcore bench: backend {out['backend']!r}, {args.blocks} blocks of the typical "
        f"layout ({f['bytes_per_op'] / 2**20:.0f} MiB per op), median of {args.repeats}"
    )
    print(f"  write   {f['write_gbps']:7.2f} GB/s")
    print(f"  read    {f['read_gbps']:7.2f} GB/s")
    print(f"  query   {f['query_ms']:7.2f} ms for {args.blocks} blocks")
    print(f"  memcpy  {f['memcpy_gbps']:7.2f} GB/s (baseline)")
    if "raw_write_gbps" in f:
        print(f"  raw write {f['raw_write_gbps']:5.2f} GB/s -> ratio {r['write_vs_raw']:.2f}")
    if "raw_read_gbps" in f:
        print(f"  raw read  {f['raw_read_gbps']:5.2f} GB/s -> ratio {r['read_vs_raw']:.2f}")
    print("  bytes verified" if out["verified"] else "  BYTES DIFFER")
    return 0 if out["verified"] else 2
