"""LMCache's own L2 benchmark (``lmcache bench l2``) on the kvcore adapter over kv_file, against
LMCache's own file-system adapters on the same file system, in the same run.

Each repetition runs ``lmcache bench l2`` once per contender, in alternating order, each on a
fresh directory under ``--dir``: ``--rounds`` measured rounds of ``--in-flight`` submits of
``--num-keys`` objects of ``--data-size-kb`` KiB, storing then loading the same keys, with
LMCache's round-trip check of the loaded bytes on (``--no-skip-verify``: a run whose bytes
differ, or whose store or load missed a key, fails the benchmark). A contender's figure for a
repetition is its median round's throughput (MB/s, LMCache's megabytes: 2**20 bytes).

Contenders:

- ``kvcore``: ``KVCoreL2Adapter`` over kv_file as a user runs it (layouts stored and checked
  at load, kv_file's checksums, 4 adapter threads);
- ``lmcache_fs``: LMCache's ``fs`` adapter (aiofiles; raw payloads, no checksum, no layout);
- ``lmcache_fs_native``: LMCache's ``fs_native`` adapter (its C++ connector, 4 workers; raw
  payloads, no checksum): the fastest file adapter LMCache ships, reported for reference.

Ratios: kvcore over each LMCache adapter, per repetition, for store and load. Goals (issue
42): at least 1.0 against ``lmcache_fs`` for both. Runs with the LMCache adapter's venv
(``integrations/lmcache/scripts/test.sh`` creates it); the benchmark itself only starts it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import REPO, Report, emit

LMCACHE_VENV = REPO / "integrations" / "lmcache" / ".venv"
LMCACHE = LMCACHE_VENV / "bin" / "lmcache"
OPS = {"Store": "store", "Load": "load"}


def adapter_spec(contender: str, root: str) -> dict[str, Any]:
    if contender == "kvcore":
        return {
            "type": "plugin",
            "module_path": "kvcore_lmcache.l2",
            "class_name": "KVCoreL2Adapter",
            "adapter_params": {"backend": "file", "backend_config": {"root": root}},
        }
    if contender == "lmcache_fs":
        return {"type": "fs", "base_path": root}
    if contender == "lmcache_fs_native":
        return {"type": "fs_native", "base_path": root}
    raise ValueError(f"unknown contender {contender!r}")


def run_once(contender: str, base: Path, args: argparse.Namespace) -> dict[str, float]:
    """One ``lmcache bench l2`` run: ``{"store": MB/s, "load": MB/s}`` (median round)."""
    work = Path(tempfile.mkdtemp(prefix=f"{contender}-", dir=base))
    out = work / "result.json"
    env = dict(os.environ, LMCACHE_DISABLE_BANNER="1", LMCACHE_TRACK_USAGE="false")
    cmd = [
        str(LMCACHE), "bench", "l2",
        "--l2-adapter", json.dumps(adapter_spec(contender, str(work / "store"))),
        "--num-keys", str(args.num_keys), "--in-flight", str(args.in_flight),
        "--data-size-kb", str(args.data_size_kb), "--rounds", str(args.rounds),
        "--warmup-rounds", "1", "--no-skip-verify",
        "--format", "json", "--output", str(out), "-q",
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            sys.exit(
                f"lmcache bench l2 ({contender}) failed (exit {done.returncode}): the round "
                f"trip's bytes differ or the run broke\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        metrics = json.loads(out.read_text())["metrics"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb_per_round = metrics["config"]["data_per_round_mb"]
    got: dict[str, float] = {}
    for entry in metrics.values():
        op = OPS.get(entry.get("operation", "")) if isinstance(entry, dict) else None
        if op is None:
            continue
        if entry["total_success"] != entry["total_keys"]:
            sys.exit(f"{contender}: {op} succeeded for {entry['total_success']} of "
                     f"{entry['total_keys']} keys")  # fmt: skip
        got[op] = mb_per_round / (entry["duration_p50_ms"] / 1000.0)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="repetitions (each runs every contender)")
    ap.add_argument("--rounds", type=int, default=10, help="measured rounds per bench run")
    ap.add_argument("--num-keys", type=int, default=32, help="objects per submit")
    ap.add_argument("--in-flight", type=int, default=4, help="submits in flight per round")
    ap.add_argument("--data-size-kb", type=int, default=256, help="KiB per object")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="file system under test")
    ap.add_argument(
        "--contenders",
        default="kvcore,lmcache_fs,lmcache_fs_native",
        help="comma-separated (kvcore first: the ratios are kvcore over each other)",
    )
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args()
    if not LMCACHE.exists():
        sys.exit(
            f"bench_lmcache needs {LMCACHE}: run integrations/lmcache/scripts/test.sh "
            "--setup-only once"
        )
    contenders = args.contenders.split(",")
    base = Path(tempfile.mkdtemp(prefix="kvcore-bench-lmcache-", dir=args.dir))
    results: dict[str, dict[str, list[float]]] = {c: {"store": [], "load": []} for c in contenders}
    try:
        for rep in range(args.reps):
            order = contenders if rep % 2 == 0 else contenders[::-1]
            for contender in order:
                for op, mbps in run_once(contender, base, args).items():
                    results[contender][op].append(mbps)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    report = Report()
    for contender, ops in results.items():
        for op, values in ops.items():
            report.figure(f"{contender}_{op}_mbps", values, "MB/s")
    mine = results["kvcore"]
    for other in contenders:
        if other == "kvcore":
            continue
        for op in ("store", "load"):
            goal = ">= 1.0" if other == "lmcache_fs" else None
            report.ratio(f"kvcore_vs_{other}_{op}", mine[op], results[other][op], goal=goal)
    report.notes["setup"] = {
        "objects_per_round": args.num_keys * args.in_flight,
        "object_kib": args.data_size_kb,
        "rounds": args.rounds,
        "dir": args.dir,
        "verified": "lmcache bench l2 --no-skip-verify (every run)",
    }
    emit(report.as_dict(), args.json)


if __name__ == "__main__":
    main()
