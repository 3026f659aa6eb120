"""``kvcore replay TRACE``: a production trace through a store, at one or more capacities.

Every (capacity, policy) pair is one replay; the report lists each with its hit rate against
the trace's maximum and the offline optimum at that capacity. ``--plot`` draws hit rate
against capacity, one line per policy, the maximum and the optimum dashed.

Tenants (issue 61): ``--tenant NAME=TRACE`` adds another tenant's trace, ``--flood NAME=X`` a
tenant writing X times the capacity in unique blocks over the trace's span; all are merged by
time (``TRACE`` is the tenant ``--as`` names) and each tenant's hit rate is reported.
``--tenants`` gives their shares of the store (:class:`kvcore.tenants.TenantSettings`), in
bytes of the replay's blocks (``--simulate``: the model's; an I/O replay gives kv_file the
same number of blocks), so an operator can size shares before deploying.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from pydantic import ByteSize, TypeAdapter, ValidationError

from kvcore.admission import POLICIES
from kvcore.cli.console import CommandConsole, Table, print_table, step_progress
from kvcore.cli.errors import CliError, ExitCode
from kvcore.cli.plot import require_matplotlib
from kvcore.config import parse_config_arg
from kvcore.errors import ConfigError
from kvcore.replay import (
    Bounds,
    Trace,
    TraceError,
    flood_trace,
    load_trace,
    merge_traces,
    replay,
)
from kvcore.replay.model import store_model_of
from kvcore.tenants import TenantSettings, check_tenant_name

_TOKENS = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]?)\s*$")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_tokens(text: str, option: str) -> int:
    """``3M`` -> 3,000,000 tokens (decimal suffixes k, M, G)."""
    m = _TOKENS.match(text)
    if not m:
        raise CliError(
            f"{option}: {text!r} is not a token count (e.g. 3000000, 500k, 3M)", ExitCode.USAGE
        )
    value = int(float(m.group(1)) * _SCALE[m.group(2).lower()])
    if value <= 0:
        raise CliError(f"{option}: {text!r} must be more than 0 tokens", ExitCode.USAGE)
    return value


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("trace", metavar="TRACE", help="a trace in the Mooncake JSONL format")
    sp.add_argument(
        "--policy",
        default="adaptive",
        metavar="NAMES",
        help=f"admission policies to replay, comma-separated, from: {', '.join(POLICIES)} "
        "(default: %(default)s)",
    )
    sp.add_argument(
        "--capacities",
        default="3M",
        metavar="TOKENS",
        help="store capacities in tokens, comma-separated, e.g. 1M,3M,10M (a capacity in "
        "blocks is tokens / tokens per block, rounded down) (default: %(default)s)",
    )
    sp.add_argument(
        "--simulate",
        action="store_true",
        help="replay on a model of kv_file's store (metadata only, no I/O): the same "
        "policy, the same hit counts, seconds instead of minutes (default: real I/O)",
    )
    sp.add_argument(
        "--block-bytes",
        default="16KiB",
        metavar="SIZE",
        help="bytes each block holds (K and V) in an I/O replay (default: %(default)s)",
    )
    sp.add_argument(
        "--tokens-per-block",
        type=int,
        default=512,
        metavar="N",
        help="tokens per hash id of the trace (default: %(default)s, as in Mooncake's traces)",
    )
    sp.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="replay the first N requests only (default: all)",
    )
    sp.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="NAME=TRACE",
        help="another tenant's trace, merged with TRACE by time; repeatable (default: none)",
    )
    sp.add_argument(
        "--flood",
        action="append",
        default=[],
        metavar="NAME=X",
        help="a tenant writing X times the capacity in unique blocks, spread over TRACE's "
        "span (a noisy neighbour); repeatable (default: none)",
    )
    sp.add_argument(
        "--as",
        dest="as_tenant",
        default="default",
        metavar="NAME",
        help="TRACE's tenant, where there are tenants (default: %(default)s)",
    )
    sp.add_argument(
        "--tenants",
        default=None,
        metavar="JSON_OR_PATH",
        help="the tenants' shares (reserved_bytes, quota_bytes per tenant), a JSON object or "
        "the path of a JSON file, in bytes of --block-bytes blocks (default: no shares)",
    )
    sp.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="draw hit rate against capacity, one line per policy, the maximum and the "
        "optimum dashed (needs matplotlib: pip install 'kvcore[plot]') (default: no chart)",
    )


def run(args: argparse.Namespace, console: CommandConsole) -> int:
    from kvcore.cli.options import load_config_arg

    if args.limit is not None and args.limit < 1:
        raise CliError(f"--limit: {args.limit} must be at least 1", ExitCode.USAGE)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            raise CliError(f"--policy: {p!r} is not one of {', '.join(POLICIES)}", ExitCode.USAGE)
    capacities = [parse_tokens(c, "--capacities") for c in args.capacities.split(",") if c.strip()]
    try:
        block_bytes = int(TypeAdapter(ByteSize).validate_python(args.block_bytes))
    except ValidationError:
        raise CliError(
            f"--block-bytes: {args.block_bytes!r} is not a size (e.g. 16KiB, 65536)",
            ExitCode.USAGE,
        ) from None
    if args.plot:
        require_matplotlib()
    try:
        trace = load_trace(args.trace, limit=args.limit, tokens_per_block=args.tokens_per_block)
    except TraceError as exc:
        raise CliError(str(exc), ExitCode.USAGE) from None
    config = load_config_arg(args.config)
    tenants = _tenants(args)
    others = _other_tenants(args, trace.tokens_per_block)
    floods = _floods(args)
    tenanted = bool(others or floods or tenants is not None)
    if tenanted:
        check_tenant_name_arg(args.as_tenant, "--as")
    if args.simulate:
        try:  # before any work: the model is the backend's own
            store_model_of(args.backend)
        except ValueError as exc:
            raise CliError(f"--backend: {exc}", ExitCode.USAGE) from None
    parts = {args.as_tenant: trace, **others}
    if tenanted:
        trace = merge_traces(parts)
    bounds = Bounds(trace)
    reports: list[dict[str, Any]] = []
    runs = [(c, p) for c in capacities for p in policies]
    for tokens in capacities:
        if tenants is not None:
            try:
                tenants.check_capacity(max(1, tokens // trace.tokens_per_block) * block_bytes)
            except ValueError as exc:
                raise CliError(f"--tenants: {exc}", ExitCode.CONFIG) from None
    flood_requests = len(parts[args.as_tenant]) * len(floods)
    total = (len(trace) + flood_requests) * len(runs)
    with step_progress(console.err, "replay", total, "requests") as bar:
        for tokens, policy in runs:
            blocks = max(1, tokens // trace.tokens_per_block)
            served = _flooded(trace, parts, floods, blocks * trace.tokens_per_block)
            reports.append(
                replay(
                    served,
                    capacity_blocks=blocks,
                    policy=policy,
                    simulate_only=args.simulate,
                    backend=args.backend,
                    config=config,
                    block_bytes=block_bytes,
                    bounds=bounds if served is trace else Bounds(served),
                    progress=bar.advance,
                    tenants=tenants,
                )
            )
    out: dict[str, Any] = {
        "trace": trace.source,
        "requests": len(trace),
        "block_refs": trace.block_refs,
        "distinct_blocks": trace.distinct_blocks,
        "max_hit_rate_blocks": bounds.maximum.hit_rate_blocks,
        "runs": reports,
    }
    if args.plot:
        plot_sweep(reports, out["max_hit_rate_blocks"], Path(args.plot), trace.source)
        out["plot"] = args.plot
    if args.json:
        console.out.print_json(json.dumps(out))
    else:
        _print(out, console)
    bad = sum(r["mismatches"] for r in reports)
    if bad:
        return ExitCode.FAILED
    return ExitCode.BACKEND_FAILED if sum(r["errors"] for r in reports) else ExitCode.OK


def check_tenant_name_arg(name: str, option: str) -> str:
    try:
        return check_tenant_name(name, option)
    except ValueError as exc:
        raise CliError(str(exc), ExitCode.USAGE) from None


def _named(entry: str, option: str) -> tuple[str, str]:
    name, sep, value = entry.partition("=")
    if not sep or not value:
        raise CliError(f"{option}: {entry!r} is not NAME=VALUE", ExitCode.USAGE)
    return check_tenant_name_arg(name, option), value


def _other_tenants(args: argparse.Namespace, tokens_per_block: int) -> dict[str, Trace]:
    """``--tenant NAME=TRACE``: each tenant's trace, read as TRACE is."""
    out: dict[str, Trace] = {}
    for entry in args.tenant:
        name, path = _named(entry, "--tenant")
        if name in out or name == args.as_tenant:
            raise CliError(f"--tenant: tenant {name!r} is given twice", ExitCode.USAGE)
        try:
            out[name] = load_trace(path, limit=args.limit, tokens_per_block=tokens_per_block)
        except TraceError as exc:
            raise CliError(f"--tenant {name}: {exc}", ExitCode.USAGE) from None
    return out


def _floods(args: argparse.Namespace) -> dict[str, float]:
    """``--flood NAME=X``: each flooding tenant's writes, in capacities."""
    out: dict[str, float] = {}
    for entry in args.flood:
        name, value = _named(entry, "--flood")
        try:
            times = float(value)
        except ValueError:
            times = -1.0
        if not 0 < times <= 10_000:
            raise CliError(
                f"--flood {name}: {value!r} must be a number of capacities in (0, 10000]",
                ExitCode.USAGE,
            )
        if (
            name in out
            or name == args.as_tenant
            or name in {e.partition("=")[0] for e in args.tenant}
        ):
            raise CliError(f"--flood: tenant {name!r} is given twice", ExitCode.USAGE)
        out[name] = times
    return out


def _tenants(args: argparse.Namespace) -> TenantSettings | None:
    """``--tenants``: the shares, checked (an error names the field)."""
    if args.tenants is None:
        return None
    try:
        raw = parse_config_arg(args.tenants)
        return TenantSettings.model_validate(raw)
    except ValidationError as exc:
        fields = ConfigError.from_validation("tenants", exc).fields
        said = "; ".join(f"{loc}: {msg}" if loc else msg for loc, msg in fields)
        raise CliError(f"--tenants: {said}", ExitCode.CONFIG) from None
    except ValueError as exc:
        raise CliError(f"--tenants: {exc}", ExitCode.CONFIG) from None


def _flooded(
    trace: Trace, parts: dict[str, Trace], floods: dict[str, float], capacity_tokens: int
) -> Trace:
    """``trace`` (the tenants' ``parts`` merged) with each ``--flood`` tenant's unique blocks
    merged in: sized by the capacity, spread over the first part's (TRACE's) span."""
    if not floods:
        return trace
    base = next(iter(parts.values()))
    first, last = base.requests[0].timestamp_ms, base.requests[-1].timestamp_ms
    blocks = max(1, capacity_tokens // trace.tokens_per_block)
    noisy = {
        name: flood_trace(
            max(1, round(times * blocks)),
            requests=len(base),
            span_ms=last - first,
            tokens_per_block=trace.tokens_per_block,
            start_ms=first,
        )
        for name, times in floods.items()
    }
    return merge_traces({**parts, **noisy})


def _print(out: dict[str, Any], console: CommandConsole) -> None:
    runs = out["runs"]
    console.out.print(
        f"{out['trace']}: {out['requests']} requests, {out['block_refs']} block references, "
        f"{out['distinct_blocks']} distinct blocks; maximum hit rate "
        f"{100 * out['max_hit_rate_blocks']:.1f} % (unlimited capacity)",
        markup=False,
    )
    table = Table(box=None)
    for col in ("capacity (tokens)", "policy", "mode", "hit rate", "of optimum", "optimum",
                "written", "bytes/hit", "evictions", "read p50/p99", "wall"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("policy", "mode") else "right")
    for r in runs:
        per_hit = r["bytes_written_per_block_hit"]
        lat = (
            f"{r['read_latency_ms_p50']:.2f}/{r['read_latency_ms_p99']:.2f} ms"
            if r["read_latency_ms_p50"] is not None
            else "-"
        )
        table.add_row(
            f"{r['capacity_tokens']:,}",
            r["policy"],
            r["mode"],
            f"{100 * r['hit_rate_blocks']:.2f} %",
            f"{r['of_optimum']:.3f}",
            f"{100 * r['optimum_hit_rate_blocks']:.2f} %",
            f"{r['bytes_written'] / 2**20:,.0f} MiB",
            "-" if per_hit is None else f"{per_hit / 2**10:,.0f} KiB",
            f"{r['evictions']:,}",
            lat,
            f"{r['wall_s']:.1f} s",
        )
    print_table(console.out, table)
    if any(r["tenants"] for r in runs):
        per = Table(box=None)
        for col in ("capacity (tokens)", "policy", "tenant", "requests", "hit rate",
                    "written", "refused", "evicted"):  # fmt: skip
            per.add_column(col, justify="left" if col in ("policy", "tenant") else "right")
        for r in runs:
            for name, t in r["tenants"].items():
                per.add_row(
                    f"{r['capacity_tokens']:,}",
                    r["policy"],
                    name,
                    f"{t['requests']:,}",
                    f"{100 * t['hit_rate_blocks']:.2f} %",
                    f"{t['blocks_written']:,}",
                    f"{t['blocks_refused']:,}",
                    f"{t['evictions']:,}",
                )
        print_table(console.out, per)
    if any(r["mismatches"] for r in runs):
        console.out.print("FAILED: restored bytes differ from what was stored")
    for r in runs:
        for sample in r["error_samples"]:
            console.out.print(f"  error: {sample}", markup=False)


def plot_sweep(reports: list[dict[str, Any]], maximum: float, path: Path, title: str) -> None:
    """Hit rate against capacity: one line per policy, the maximum and the optimum dashed."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = sorted({r["capacity_tokens"] for r in reports})
    optimum = {r["capacity_tokens"]: r["optimum_hit_rate_blocks"] for r in reports}
    for policy in dict.fromkeys(r["policy"] for r in reports):
        points = sorted(
            (r["capacity_tokens"], r["hit_rate_blocks"]) for r in reports if r["policy"] == policy
        )
        modes = {r["mode"] for r in reports if r["policy"] == policy}
        ax.plot(*zip(*points, strict=True), marker="o", label=f"{policy} ({'/'.join(modes)})")
    ax.plot(caps, [optimum[c] for c in caps], "k--", marker=".", label="optimum (Belady)")
    ax.axhline(maximum, color="grey", linestyle="--", label="maximum (unlimited)")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (tokens)")
    ax.set_ylabel("prefix hit rate (blocks)")
    ax.set_ylim(0, max(maximum * 1.1, 0.05))
    ax.set_title(Path(title).name, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
