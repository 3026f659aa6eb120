"""``kvcore bench``: write, read and query throughput through kvcore beside raw baselines.

Baselines measured in the same run: memcpy of the same bytes, and the backend's own raw
figures when it provides them (``kvcore_raw_baseline``: raw disk I/O for ``file``, the raw
client for ``mooncake``). Each figure is the median of ``--repeats`` repetitions.

Each repetition writes new keys under the run's own namespace; unless ``--keep``, what a
repetition wrote is removed after it (the backend's remove hook) and the namespace is cleared
at the end (its clear hook), so a run leaves nothing behind on a backend that has them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from kvcore.backend import Backend
from kvcore.cli.common import clear_scratch, open_for_cli, scratch_namespace
from kvcore.cli.console import CommandConsole, step_progress
from kvcore.cli.errors import CliError, ExitCode
from kvcore.keys import KeyScope, block_hashes
from kvcore.ops import HostBuffer
from kvcore.requests import HostBuffers
from kvcore.schemas import BackendContext, CacheDType, CacheLayout

__all__ = ["GB", "TYPICAL", "measure", "run", "staging_regions"]

#: the typical layout of the issues: 28 layers x 8 heads x 64 tokens x 128 dim, bfloat16
TYPICAL = CacheLayout(
    num_layers=28, num_heads=8, block_size=64, head_dim=128, dtype=CacheDType.bfloat16
)
GB = 1e9  # GB/s are 10^9 bytes per second in every kvcore figure


def staging_regions(layout: CacheLayout, n: int) -> tuple[list[HostBuffer], HostBuffers]:
    """One page-aligned, pre-faulted host region per part for ``n`` blocks, and the host
    buffers of a request over them (block ``i``'s part ``j`` at ``i * part_bytes`` of region
    ``j``): the staging the bench measures through, for benchmarks to use alike."""
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


def measure(
    backend: Backend,
    layout: CacheLayout,
    blocks: int,
    repeats: int,
    progress: Any = None,
    keep: bool = True,
) -> dict[str, Any]:
    """Figures, ratios and goals of one run (medians of ``repeats``). ``progress.advance()`` is
    called after each step; unless ``keep``, each repetition's blocks are removed after it."""
    progress = progress or _NoProgress()
    src, src_host = staging_regions(layout, blocks)
    dst, dst_host = staging_regions(layout, blocks)
    rng = np.random.default_rng(0)
    for r in src:
        r.array[:] = rng.integers(0, 256, r.nbytes, dtype=np.uint8)
    nbytes = sum(r.nbytes for r in src)
    for r in (*src, *dst):
        backend.register_buffer(r.ptr, r.nbytes)
    progress.advance(note="buffers filled")
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
            why = "; ".join(o.failure for o in (wrote, found, got) if o.failure)
            raise CliError(
                f"backend {backend.name!r} stored {wrote}, found {found}, read {got} of {blocks} "
                f"blocks{f' ({why})' if why else ''}; its log lines say more (kvcore -v bench)",
                ExitCode.BACKEND_FAILED,
            )
        verified &= all(np.array_equal(a.array, b.array) for a, b in zip(src, dst, strict=True))
        for a, b in zip(src, dst, strict=True):
            c0 = time.perf_counter()
            np.copyto(b.array, a.array)
            copies.append(time.perf_counter() - c0)
        writes.append(t1 - t0)
        queries.append(t2 - t1)
        reads.append(t3 - t2)
        if not keep:  # bound the scratch data to one repetition's blocks
            backend.remove(req())
        progress.advance(note=f"write {nbytes / GB / (t1 - t0):.2f} GB/s")
    copy_s = statistics.median(copies) * len(src)
    raws = []
    for _ in range(repeats):
        raws.append(backend.raw_baseline(src[0].ptr, src[0].nbytes, layout.part_bytes("k")))
        progress.advance(note="raw baseline")
    raw = {
        k: statistics.median(r[k] for r in raws if k in r)
        for k in ("write_gbps", "read_gbps")
        if any(k in r for r in raws)
    }
    for r in (*src, *dst):
        backend.unregister_buffer(r.ptr)
    write_gbps = nbytes / GB / statistics.median(writes)
    read_gbps = nbytes / GB / statistics.median(reads)
    figures: dict[str, float] = {
        "bytes_per_op": nbytes,
        "blocks": blocks,
        "write_gbps": write_gbps,
        "read_gbps": read_gbps,
        "query_ms": statistics.median(queries) * 1e3,
        "memcpy_gbps": nbytes / GB / copy_s,
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


class _NoProgress:
    def advance(self, n: int = 1, note: str = "") -> None:
        pass


def run(args: argparse.Namespace, console: CommandConsole) -> int:
    from kvcore.cli.options import load_config_arg

    config = load_config_arg(args.config)
    if args.plot:
        from kvcore.cli.plot import require_matplotlib

        require_matplotlib()  # before the work: a missing extra should not cost a whole run
        folder = Path(args.plot).expanduser().resolve().parent
        if not folder.is_dir():
            raise CliError(
                f"--plot: cannot write the chart: no directory {str(folder)!r}", ExitCode.USAGE
            )
    namespace = scratch_namespace("bench", args.namespace)
    context = BackendContext(layout=TYPICAL, namespace=namespace)
    backend = open_for_cli(args.backend, config, context)
    try:
        steps = 1 + 2 * args.repeats  # buffers, the repetitions, then the raw baselines
        with step_progress(console.err, "bench", steps, "steps") as progress:
            out = measure(backend, TYPICAL, args.blocks, args.repeats, progress, args.keep)
        out["namespace"] = namespace
        out["data"] = clear_scratch(backend, args.keep)
    finally:
        backend.close()
    if args.plot:
        from kvcore.cli.plot import plot_report

        plot_report(out, args.plot, title=f"kvcore bench --backend {out['backend']}")
    if args.json:
        console.out.print_json(json.dumps(out))
        return ExitCode.OK if out["verified"] else ExitCode.FAILED
    f, r = out["figures"], out["ratios"]
    lines = [
        f"kvcore bench: backend {out['backend']!r}, {args.blocks} blocks of the typical layout "
        f"({f['bytes_per_op'] / 2**20:.0f} MiB per op), median of {args.repeats}",
        f"  write   {f['write_gbps']:7.2f} GB/s",
        f"  read    {f['read_gbps']:7.2f} GB/s",
        f"  query   {f['query_ms']:7.2f} ms for {args.blocks} blocks",
        f"  memcpy  {f['memcpy_gbps']:7.2f} GB/s (baseline)",
    ]
    if "raw_write_gbps" in f:
        lines.append(
            f"  raw write {f['raw_write_gbps']:5.2f} GB/s -> ratio {r['write_vs_raw']:.2f}"
        )
    if "raw_read_gbps" in f:
        lines.append(f"  raw read  {f['raw_read_gbps']:5.2f} GB/s -> ratio {r['read_vs_raw']:.2f}")
    lines.append("  bytes verified" if out["verified"] else "  BYTES DIFFER")
    lines.append(f"  data: {out['data']}")
    if args.plot:
        lines.append(f"  chart: {args.plot}")
    for line in lines:
        console.out.print(line, markup=False, highlight=False)
    return ExitCode.OK if out["verified"] else ExitCode.FAILED
