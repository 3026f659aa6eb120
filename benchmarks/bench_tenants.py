"""What a reserved share keeps for a quiet tenant beside a noisy one: a replay on the model of
kv_file's store (``kvcore replay --simulate`` with tenants, :mod:`kvcore.tenants`).

Tenant A is the Mooncake FAST'25 conversation trace (``shared/data``); tenant B is a flood of
unique blocks nobody reads again (``kvcore.replay.trace.flood_trace``), ``--floods`` times the
store's capacity, spread evenly over A's time span, merged with A by time. Per capacity (tokens,
512 a block) and flood size:

- ``alone``: A by itself on a store of half the capacity (what a reservation of half must at
  least give it);
- ``shares``: A and B on the whole store, A with ``reserved_bytes`` of half of it, B with none;
- ``no_shares``: A and B on the whole store, one LRU for both (kvcore before tenants);
- ``only_a_shares``: A by itself on the whole store, with its share set (the others' room
  unused: work-conserving means it is A's);
- ``no_tenants``: A by itself on the whole store, without tenants.

Ratios, named as issue 61 names them for the flood of ``10x`` (other floods carry their size):
``<cap>_quiet_tenant_vs_alone`` (shares / alone, goal >= 0.95),
``<cap>_quiet_tenant_no_shares_vs_alone`` (no_shares / alone: reported) and
``<cap>_work_conserving_vs_no_tenants`` (only_a_shares / no_tenants, goal >= 0.97).

Admission ``all`` (every write stored: what lets a flood in) gives the ratios; ``adaptive``'s
hit rates are reported as figures. Hit counts are a function of the trace and the settings:
repetitions give the same counts (a spread of 0 by construction).

``--io``: each arm of ``all`` at the first flood size is also replayed through kv_file itself
(``kvcore replay`` without ``--simulate``: real files, the journal, the shares as the store
enforces them, every block's bytes checked), once, and its hit rate compared with the
model's: ``<cap>_<arm>_io_vs_simulate`` (goal within 2 %: issue 61).

``--state``: what kv_file's per-tenant state costs in memory, measured as the resident set of
a fresh process holding an index of ``--state-objects`` objects: spread over 256 tenants with
shares (each tenant's own LRU order, :mod:`kv_file.shares`) against the same objects without
tenants; ``state_bytes_per_object_*`` and their difference. The facade's per-tenant counters
are bounded by construction (256 tenant labels, then ``other``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchutil import Report, emit

from kvcore.replay import Trace, flood_trace, load_trace, merge_traces, replay, simulate
from kvcore.tenants import TenantSettings

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared/data/mooncake_conversation_trace.jsonl"
)


def label(tokens: int) -> str:
    return f"{tokens // 10**6}M" if tokens % 10**6 == 0 else f"{tokens}t"


def arms(
    quiet: Trace,
    capacity_blocks: int,
    flood_x: int,
    policy: str,
    block_bytes: int,
    io_root: str | None = None,
) -> dict[str, float]:
    """A's hit rate (blocks) in each arm of the module docstring: on the model, or (with
    ``io_root``) through kv_file in that directory."""
    half = capacity_blocks // 2
    span = quiet.requests[-1].timestamp_ms - quiet.requests[0].timestamp_ms
    flood = flood_trace(
        flood_x * capacity_blocks,
        requests=len(quiet),
        span_ms=span,
        tokens_per_block=quiet.tokens_per_block,
        start_ms=quiet.requests[0].timestamp_ms,
    )
    both = merge_traces({"A": quiet, "B": flood})
    only_a = merge_traces({"A": quiet})
    shares = TenantSettings(tenants={"A": {"reserved_bytes": half * block_bytes}, "B": {}})

    def rate_of(trace: Trace, blocks: int, tenants: TenantSettings | None) -> float:
        if io_root is not None:
            run = replay(
                trace,
                capacity_blocks=blocks,
                policy=policy,  # type: ignore[arg-type]
                config={"root": io_root},
                block_bytes=block_bytes,
                tenants=tenants,
            )
            assert run["mismatches"] == 0 and run["errors"] == 0, run["error_samples"]
            return float(run["tenants"].get("A", run)["hit_rate_blocks"])
        tally, _ = simulate(trace, blocks, policy, block_bytes=block_bytes, tenants=tenants)  # type: ignore[arg-type]
        own = tally.tenants.get("A", tally)
        return own.hit_rate_blocks

    return {
        "alone": rate_of(quiet, half, None),
        "shares": rate_of(both, capacity_blocks, shares),
        "no_shares": rate_of(both, capacity_blocks, TenantSettings()),
        "only_a_shares": rate_of(only_a, capacity_blocks, shares),
        "no_tenants": rate_of(quiet, capacity_blocks, None),
    }


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def state_worker(objects: int, tenants: int) -> None:
    """Print the resident bytes an index of ``objects`` objects adds (``tenants`` > 0: spread
    over that many tenants, each with a share)."""
    from kv_file.index import Index

    from kvcore.tenants import TenantSettings

    settings = None
    if tenants:
        settings = TenantSettings(tenants={f"t{i}": {"reserved_bytes": 1} for i in range(tenants)})
    index = Index(1 << 60, 1.0, 1.0, settings)
    names = [f"ns/{i:08x}/k" for i in range(objects)]  # made before the first measurement
    owners = [f"t{i % tenants}" if tenants else None for i in range(objects)]
    before = _rss_bytes()
    index.add_many((i, 4096, names[i], False, None, owners[i]) for i in range(objects))
    print(json.dumps({"bytes": _rss_bytes() - before, "objects": len(index)}))


def state_rss(objects: int, tenants: int) -> int:
    out = subprocess.run(
        [sys.executable, __file__, "--state-worker", str(objects), str(tenants)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(json.loads(out.stdout.strip().splitlines()[-1])["bytes"])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--state-worker":
        state_worker(int(sys.argv[2]), int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--capacities", default="1000000,3000000", help="tokens")
    ap.add_argument("--floods", default="10,100,1000", help="B's unique blocks, x capacity")
    ap.add_argument("--policies", default="all,adaptive")
    ap.add_argument("--reps", type=int, default=2, help="counts repeat exactly (a check of it)")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of A only")
    ap.add_argument("--block-bytes", type=int, default=16 << 10)
    ap.add_argument("--io", action="store_true", help="also replay through kv_file (see above)")
    ap.add_argument("--io-root", default=None, help="where --io's stores go (default: a temp dir)")
    ap.add_argument("--state", action="store_true", help="measure per-tenant state (see above)")
    ap.add_argument("--state-objects", type=int, default=1_000_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    quiet = load_trace(args.trace, limit=args.limit)
    capacities = [int(c) for c in args.capacities.split(",")]
    floods = [int(f) for f in args.floods.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    report = Report()
    pct = 100.0
    for tokens in capacities:
        c = label(tokens)
        blocks = tokens // quiet.tokens_per_block
        for flood_x in floods:
            for policy in policies:
                runs = [
                    arms(quiet, blocks, flood_x, policy, args.block_bytes) for _ in range(args.reps)
                ]
                tag = f"{c}_flood{flood_x}x_{policy}"
                for arm in runs[0]:
                    report.figure(f"{tag}_{arm}_hit_rate_pct", [pct * r[arm] for r in runs], "%")
                if policy != "all":
                    continue
                prefix = c if flood_x == 10 else f"{c}_flood{flood_x}x"
                alone = [r["alone"] for r in runs]
                report.ratio(
                    f"{prefix}_quiet_tenant_vs_alone",
                    [r["shares"] for r in runs],
                    alone,
                    goal=">= 0.95",
                )
                report.ratio(
                    f"{prefix}_quiet_tenant_no_shares_vs_alone",
                    [r["no_shares"] for r in runs],
                    alone,
                )
                if flood_x == floods[0]:  # B is idle in this arm: one flood size says it
                    report.ratio(
                        f"{c}_work_conserving_vs_no_tenants",
                        [r["only_a_shares"] for r in runs],
                        [r["no_tenants"] for r in runs],
                        goal=">= 0.97",
                    )
                if args.io and flood_x == floods[0]:
                    with tempfile.TemporaryDirectory(dir=args.io_root) as root:
                        io = arms(quiet, blocks, flood_x, policy, args.block_bytes, root)
                    for arm, rate in io.items():
                        report.figure(f"{tag}_{arm}_io_hit_rate_pct", [pct * rate], "%")
                        report.ratio(
                            f"{c}_{arm}_io_vs_simulate",
                            [rate],
                            [runs[0][arm]],
                            goal="within 0.98-1.02",
                        )
    if args.state:
        n = args.state_objects
        plain = [state_rss(n, 0) / n for _ in range(args.reps)]
        shared = [state_rss(n, 256) / n for _ in range(args.reps)]
        report.figure("state_bytes_per_object_no_tenants", plain, "B")
        report.figure("state_bytes_per_object_256_tenants_shares", shared, "B")
        report.figure(
            "state_bytes_per_object_of_tenants",
            [b - a for a, b in zip(plain, shared, strict=True)],
            "B",
        )
    report.notes["setup"] = {
        "trace": args.trace,
        "requests": len(quiet),
        "tokens_per_block": quiet.tokens_per_block,
        "block_bytes": args.block_bytes,
        "capacities_blocks": {label(t): t // quiet.tokens_per_block for t in capacities},
        "floods_x_capacity": floods,
        "reserved_share_of_A": 0.5,
        "mode": "simulate (kv_file's store model)"
        + ("; --io: each arm of `all` at the first flood also through kv_file" if args.io else ""),
        "cpus": os.cpu_count(),
    }
    emit(report.as_dict(), args.json)


if __name__ == "__main__":
    main()
