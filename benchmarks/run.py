"""Run benchmarks several times, each run a separate process, and report how much the runs agree.

    python benchmarks/run.py bench_file bench_transfer --runs 3 [--json]
    python benchmarks/run.py bench_file --runs 3 --args bench_file="--blocks 32 --reps 5"

Each benchmark runs ``--runs`` times with ``--json``, in alternating order (run 1: A B, run 2:
B A, ...), so a drift of the machine's state over the session falls on both alike. For every
figure and ratio the report gives the median of the runs' medians, the runs' medians
themselves, and the run-to-run spread: ``spread`` = max / min of the run medians (1.0: the runs
agree). A ratio against a baseline named as the limit whose median of runs is above 1.05 is
flagged, as each run flags it. One JSON object on stdout with ``--json`` (the runs' own reports
under ``runs``), Markdown tables for RESULTS.md with ``--markdown``, else a plain table.
``--from FILE`` re-renders a saved ``--json`` result instead of running anything.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchutil import LIMIT_TOLERANCE, machine

HERE = Path(__file__).resolve().parent


def _json_of(stdout: str) -> dict[str, Any]:
    """The last line of a benchmark's output that is a JSON object with figures."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            data = json.loads(line)
            if "figures" in data:
                return data
    raise ValueError("no JSON report in the benchmark's output")


def _median_of(entry: Any) -> float | None:
    if isinstance(entry, dict) and isinstance(entry.get("median"), (int, float)):
        return float(entry["median"])
    if isinstance(entry, (int, float)) and not isinstance(entry, bool):
        return float(entry)
    return None


def _has_range(report: dict[str, Any], section: str, key: str) -> bool:
    entry = report.get(section, {}).get(key)
    return isinstance(entry, dict) and "min" in entry and "max" in entry


def markdown(result: dict[str, Any], names: list[str]) -> str:
    """One table per benchmark: median of runs, each run's median, run-to-run spread."""
    lines: list[str] = []
    for name in names:
        combined = result[name]
        limits = set(combined["runs"][0].get("limits", []))
        runs = len(combined["runs"])
        lines += [
            f"### `{name}` — {runs} runs, seconds per run {combined['seconds']}",
            "",
            "| | median of runs | run medians | spread (max/min) | within-run range | goal |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for section in ("figures", "ratios"):
            for key, e in combined[section].items():
                unit = f" {e['unit']}" if e.get("unit") else ""
                label = f"{key} (limit)" if key in limits else key
                rng = e.get("within_run_range")
                rng_text = f"{rng[0]}–{rng[1]}" if rng else ""
                medians = ", ".join(str(round(v, 3)) for v in e["run_medians"])
                lines.append(
                    f"| {label} | {round(e['median_of_runs'], 3)}{unit} | {medians} | "
                    f"{e['spread']} | {rng_text} | {combined['goals'].get(key, '')} |"
                )
        for flag in combined["flags"] + combined.get("run_flags", []):
            lines.append(f"\nFLAG: {flag}")
        lines.append("")
    return "\n".join(lines)


def run_once(name: str, extra: list[str], timeout_s: float) -> tuple[dict[str, Any], float]:
    script = HERE / f"{name}.py"
    if not script.exists():
        raise SystemExit(f"run.py: no benchmark {name!r} ({script} does not exist)")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(script), "--json", *extra],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=str(HERE),
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
        raise SystemExit(f"run.py: {name} exited with {proc.returncode}:\n{tail}")
    return _json_of(proc.stdout), time.perf_counter() - t0


def combine(name: str, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of run medians and run-to-run spread of every figure and ratio."""
    out: dict[str, Any] = {"figures": {}, "ratios": {}, "goals": reports[0].get("goals", {})}
    for section in ("figures", "ratios"):
        names = list(reports[0].get(section, {}))
        for key in names:
            medians = [_median_of(r.get(section, {}).get(key)) for r in reports]
            values = [m for m in medians if m is not None]
            if not values:
                continue
            entry: dict[str, Any] = {
                "median_of_runs": round(statistics.median(values), 4),
                "run_medians": [round(v, 4) for v in values],
                "spread": round(max(values) / min(values), 3) if min(values) > 0 else None,
            }
            # the widest range any single run saw within itself (its repetitions)
            lows = [r[section][key].get("min") for r in reports if _has_range(r, section, key)]
            highs = [r[section][key].get("max") for r in reports if _has_range(r, section, key)]
            if lows and highs:
                entry["within_run_range"] = [min(lows), max(highs)]
            first = reports[0][section][key]
            if isinstance(first, dict) and first.get("unit"):
                entry["unit"] = first["unit"]
            out[section][key] = entry
    limits = set(reports[0].get("limits", []))
    out["flags"] = [
        f"baseline defect: {name} {key}: median of runs {e['median_of_runs']} > {LIMIT_TOLERANCE}"
        for key, e in out["ratios"].items()
        if key in limits and e["median_of_runs"] > LIMIT_TOLERANCE
    ]
    out["run_flags"] = sorted({f for r in reports for f in r.get("flags", [])})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("names", nargs="*", help="benchmarks: file names in benchmarks/ without .py")
    ap.add_argument("--runs", type=int, default=3, help="runs of each benchmark (default: 3)")
    ap.add_argument(
        "--args",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help='extra arguments for one benchmark, e.g. bench_file="--reps 5"',
    )
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run (default 3600)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="tables for RESULTS.md")
    ap.add_argument("--from", dest="from_file", default=None, help="a saved --json result")
    args = ap.parse_args()
    if args.from_file:
        result = json.loads(Path(args.from_file).read_text())
        names = args.names or [k for k in result if k != "machine"]
        print(markdown(result, names) if args.markdown else json.dumps(result))
        return 0
    if not args.names:
        ap.error("name at least one benchmark (or --from FILE)")
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    extra: dict[str, list[str]] = {}
    for item in args.args:
        name, sep, rest = item.partition("=")
        if not sep:
            ap.error(f"--args {item!r}: expected NAME=ARGS")
        extra[name] = shlex.split(rest)
    reports: dict[str, list[dict[str, Any]]] = {n: [] for n in args.names}
    seconds: dict[str, list[float]] = {n: [] for n in args.names}
    for run in range(args.runs):
        order = args.names if run % 2 == 0 else list(reversed(args.names))
        for name in order:
            report, took = run_once(name, extra.get(name, []), args.timeout)
            reports[name].append(report)
            seconds[name].append(round(took, 1))
            print(f"run.py: {name} run {run + 1}/{args.runs} ({took:.0f} s)", file=sys.stderr)
    result = {
        name: {**combine(name, reports[name]), "seconds": seconds[name], "runs": reports[name]}
        for name in args.names
    }
    result["machine"] = machine()
    if args.json:
        print(json.dumps(result))
        return 0
    if args.markdown:
        print(markdown(result, args.names))
        return 0
    for name in args.names:
        print(f"== {name} ({args.runs} runs)")
        combined = result[name]
        for section in ("figures", "ratios"):
            for key, e in combined[section].items():
                goal = combined["goals"].get(key, "")
                print(
                    f"  {key:44s} {e['median_of_runs']:>10} runs {e['run_medians']} "
                    f"spread {e['spread']} {goal}"
                )
        for flag in combined["flags"]:
            print(f"  FLAG: {flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
