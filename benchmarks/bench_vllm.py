"""KVCoreConnector in the real vLLM engine (CPU build): restored vs recomputed prefill, the
connector's per-step cost, and vLLM's own MooncakeStoreConnector side by side.

Model: a randomly initialised Llama written on the spot (``kvcore_vllm.session``'s ``bench``
size: 8 layers, hidden 1024, 16 query / 8 KV heads of 64, MLP 2816, vocab 4096; ~0.1 B
parameters, bfloat16; 16 KiB of KV per token). Blocks of 32 tokens, ``max_model_len`` 8192.
Every engine is a fresh process; each one first serves a short warm-up prompt.

- **TTFT, recomputed vs restored** (kv_file): a 6000-token prompt on an engine without the
  connector, and on a fresh engine with KVCoreConnector over a kv_file store that an earlier
  engine filled with that prompt. The store's files are in whatever state the kernel left them:
  on this project's machines DAMON pages out file pages idle for ~30 s, which an engine's
  start-up takes, so a restore reads part of the store from disk. TTFT is vLLM's
  own first-token latency of the request. Goal: restored <= 0.25x recomputed. The restored
  engine's tokens are compared with the recomputed engine's.
- **Per-step overhead when nothing is stored**: four engines in one process take turns (the
  order rotating every round) on the same fresh 256-token prompts (every lookup misses; their
  new blocks are saved), 65 tokens each; a decode step is vLLM's (last - first token time) /
  64. Two engines have no connector (A and A': their ratio, ``decode_step_aa_control``, is
  the noise of the measurement itself), one has the connector (kv_file, empty store), one has
  it with vLLM's KV events on (the store's events built and published). Goal: the connector's
  engine at most 2 % slower per step, to be read against the A/A control's range. Beside it,
  the connector's own time on vLLM's step path (its hook calls, measured inside the engine)
  per step, with and without events: what an A/B difference is made of.
- **vLLM's MooncakeStoreConnector vs KVCoreConnector on kv_mooncake**: the same master (with a
  storage node holding the data, ``standalone-store`` mode for vLLM's connector), the same
  prompt, each restoring into a fresh engine; ratio = MooncakeStoreConnector's restored TTFT
  over ours (goal >= 1.0: ours is no slower). Ours twice: as configured by default (a digest
  object beside each block, checked on every read: kv_mooncake keeps no checksum) and with
  ``verify_blocks="never"``, which checks as little as vLLM's connector does.

- **A sliding-window hybrid, hybrid manager on vs as full attention** (``--only hybrid``):
  the tiny random Gemma 3 of the connector's tests (4 layers, a 64-token window on 2 of them)
  stores a 1,800-token prompt into kv_file and a fresh engine restores it, once with vLLM's
  hybrid KV cache manager on and once as full attention (``disable_hybrid_kv_cache_manager``,
  what vLLM does for a connector without hybrid support). Figures: the bytes storing the prompt
  writes and a restore reads (the connector's ``save_bytes``/``load_bytes``) and the restored
  TTFT, each way; ratios hybrid over full attention (goal for the bytes a restore reads: < 1).
  The hybrid restore's tokens are checked against its own recomputing engine.
- **Inter-token latency of a decode stream while a long prompt restores** (kv_file): four
  engines in one process take turns (the order rotating every round); on each, a decode stream
  (a fresh 64-token prompt, 160 tokens) runs step by step, and after its 20th token another
  request arrives with a stored ``--prompt-tokens`` prompt (one per round, stored by the sync
  engine before any round, its prefix cache reset afterwards; the store is evicted from the
  page cache before every stream, so the restore reads the disk). The stream's
  inter-token gaps from then to its last token (140), per round their median, p99 and max. Two
  engines without the connector run the stream alone (A and A': ``itl_*_aa_control`` is the
  noise); one restores with ``load_mode="sync"`` (blocks load inside the step that uses them),
  one with ``load_mode="async"`` (they load while the request waits outside the batch); these
  two also store the stream's blocks, so the connector's per-step cost (the decode part's) is in
  their ratios too. Goal: the async engine's p99 over the stream alone within the A/A
  control's spread (the goal's number is that spread, measured in the run); the sync engine's reported beside it, with
  each restore's TTFT and its ``num_cached_tokens`` (a hit: about the prompt's length). With 140
  gaps, p99 lies between the 2nd and 3rd longest: a single long step shows in the max.

Contenders alternate within every repetition; figures and per-repetition paired ratios are
reported as median, min and max. ``--only`` picks parts (ttft, decode, mooncake, hybrid, itl).
With ``--json``, one JSON object on stdout; else a table. Needs vLLM: run it with
integrations/vllm/.venv/bin/python (created by integrations/vllm/scripts/test.sh); another
Python re-executes itself with that one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_shaped  # noqa: E402
from benchutil import Report, emit, python_with_vllm  # noqa: E402

#: vLLM's setting for the cores its CPU worker's OpenMP threads are bound to
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def _same_cores_for_every_engine() -> str:
    """Bind every engine's OpenMP threads to the same cores, unless the caller chose some.

    vLLM's CPU worker picks its cores by itself, and a KV connector changes the pick: it keeps
    one core back for the scheduler process and one more whenever ``kv_transfer_config`` is set
    (``vllm/utils/ompmultiprocessing.py``, meant for NIXL), and keeps none back when that would
    take every core. On 2 cores, an engine without a connector computes on one core and an
    engine with one on both: an A/B across them measures vLLM's choice of cores (the
    connector's engine decoded 19 % faster, its restores were compared with recomputation on
    half the cores). Here all of this process's cores, for every engine alike.
    """
    if OMP_BIND_ENV not in os.environ:
        os.environ[OMP_BIND_ENV] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return os.environ[OMP_BIND_ENV]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object (default: a table)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each contender")
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--decode-prompts", type=int, default=4, help="per rep and engine")
    ap.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake comparison")
    ap.add_argument("--workdir", default=None, help="stores and logs (default: a temp dir)")
    ap.add_argument(
        "--model",
        default="bench",
        choices=("bench", "tiny"),
        help="the random model's size (tiny: for checking the report, not for figures)",
    )
    ap.add_argument(
        "--only",
        default="ttft,decode,mooncake,hybrid,itl",
        help="parts to run, comma-separated: ttft, decode, mooncake, hybrid, itl, shaped "
        "(default: all but shaped, which takes ~30 minutes: --only shaped)",
    )
    vllm_shaped.add_args(ap)
    args = ap.parse_args()
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    if not parts or parts - {"ttft", "decode", "mooncake", "hybrid", "itl", "shaped"}:
        ap.error(
            f"--only {args.only!r}: expected some of ttft, decode, mooncake, hybrid, itl, shaped"
        )
    if args.no_mooncake:
        parts.discard("mooncake")
    if "mooncake" in parts:
        parts.add("ttft")  # the Mooncake restores are checked against the recomputed tokens
    shaped_only = parts == {"shaped"}

    python_with_vllm("bench_vllm")
    omp_cores = _same_cores_for_every_engine()  # before any engine starts: they inherit it
    from kv_mooncake.testing import isolate_loopback

    # Mooncake clients listen on the wildcard address: keep them on loopback when we can
    netns = isolate_loopback()
    from kvcore_vllm.session import MODEL_SIZES, write_model

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # the engines' prefill profiles (kvcore.prefill_profile) start empty in each run, and are
    # shared by its engines as a machine's would be; not the user's cache
    from kvcore.prefill_profile import PROFILE_ENV

    os.environ[PROFILE_ENV] = str(workdir / "prefill-profiles")
    model = (
        ""
        if shaped_only
        else write_model(
            REPO / "integrations" / "vllm" / ".cache" / "models" / args.model, args.model
        )
    )
    size = MODEL_SIZES[args.model]
    if parts & {"ttft", "itl"} and args.prompt_tokens >= size["max_position_embeddings"]:
        sys.exit(
            f"--prompt-tokens {args.prompt_tokens}: the {args.model} model takes fewer than "
            f"{size['max_position_embeddings']}"
        )
    rng = random.Random(42)
    vocab = size["vocab_size"]
    long_prompt = [rng.randrange(1, vocab) for _ in range(args.prompt_tokens)]
    warm = {
        "op": "generate",
        "name": "warm",
        "prompts": [[rng.randrange(1, vocab) for _ in range(64)]],
        "max_tokens": 2,
    }
    long = {"op": "generate", "name": "long", "prompts": [long_prompt], "max_tokens": 1}
    base = {
        "model": str(model),
        "block_size": 32,
        "max_model_len": size["max_position_embeddings"],
        "kv_cache_bytes": 1 << 30 if args.model == "bench" else 64 << 20,
        "log_stats": True,
        "vocab_size": vocab,
    }

    report = Report()
    reference: list[list[int]] = []
    if "ttft" in parts:
        reference = _ttft(args, base, warm, long, workdir, report)
    if "decode" in parts:
        _decode_overhead(args, base, workdir, report)
    mooncake_note = "skipped (--no-mooncake or --only)"
    if "mooncake" in parts:
        mooncake_note = _mooncake_side_by_side(args, reference, base, warm, long, workdir, report)

    if "hybrid" in parts:
        _hybrid(args, base, workdir, report)
    if "itl" in parts:
        _itl(args, base, workdir, report)
    if "shaped" in parts:
        report.notes["shaped"] = vllm_shaped.run(args, netns, workdir, report)

    report.notes.update(
        {
            "model": f"random Llama ({args.model}): {size}, bfloat16; block 32 tokens",
            "mooncake": mooncake_note,
            "network_namespace": "private loopback" if netns is None else f"shared ({netns})",
            "reps": args.reps,
            "parts": sorted(parts),
            OMP_BIND_ENV: omp_cores,
        }
    )
    emit(report.as_dict(), args.json)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


#: the restoring engine's connector metrics each TTFT repetition keeps: its load decisions,
#: loads and lookups, and the rest of what it adds to a step (saves, the scheduler's and the
#: worker's hooks) beside the engine's own forward time, so a TTFT difference can be placed
_CONNECTOR_TIMES = ("decide_", "load_", "lookup_", "save_", "forward_", "scheduler_", "worker_")


def _ttft(
    args: argparse.Namespace,
    base: dict[str, Any],
    warm: dict[str, Any],
    long: dict[str, Any],
    workdir: Path,
    report: Report,
) -> list[list[int]]:
    """TTFT of a long prompt recomputed and restored from kv_file; returns the recomputed
    engine's tokens (the reference every restored engine must reproduce)."""
    from kvcore_vllm.session import run_in_subprocess

    file_connector = {
        "backend": "file",
        "backend_config": {"root": str(workdir / "file-store")},
        "namespace": "bench",
    }
    run_in_subprocess(
        {**base, "connector": file_connector, "steps": [warm, long]}, workdir, "file-fill"
    )
    ttft: dict[str, list[float]] = {"recomputed": [], "restored_file": []}
    restored_tokens: list[int] = []
    decisions: list[dict[str, float]] = []  # the restoring engine's load decisions, per rep
    stats = {"op": "log_stats", "name": "stats"}
    tokens_match = True
    reference: list[list[int]] = []
    for rep in range(args.reps):
        runs = {}
        order = ("recompute", "restore") if rep % 2 == 0 else ("restore", "recompute")
        for what in order:
            connector = None if what == "recompute" else file_connector
            steps = [warm, long] if connector is None else [warm, long, stats]
            runs[what] = run_in_subprocess(
                {**base, "connector": connector, "steps": steps}, workdir, f"{what}-{rep}"
            )
        plain, restored = runs["recompute"], runs["restore"]
        reference = plain.step("long")["tokens"]
        ttft["recomputed"].append(plain.step("long")["ttft_s"][0])
        ttft["restored_file"].append(restored.step("long")["ttft_s"][0])
        restored_tokens.append(restored.step("long")["num_cached_tokens"][0])
        metrics = restored.step("stats").get("metrics", {})
        decisions.append({k: v for k, v in metrics.items() if k.startswith(_CONNECTOR_TIMES)})
        tokens_match &= restored.step("long")["tokens"] == reference
    report.figure("ttft_recomputed_s", ttft["recomputed"], "s")
    report.figure("ttft_restored_kv_file_s", ttft["restored_file"], "s")
    report.ratio(
        "ttft_restored_vs_recomputed", ttft["restored_file"], ttft["recomputed"], goal="<= 0.25"
    )
    report.notes["prompt_tokens"] = args.prompt_tokens
    report.notes["restored_tokens"] = restored_tokens
    report.notes["restored_decisions"] = decisions
    report.notes["tokens_match"] = tokens_match
    return reference


#: the hybrid part's prompt (the sliding-window model takes 2,048 positions)
HYBRID_PROMPT_TOKENS = 1800


def _hybrid(args: argparse.Namespace, base: dict[str, Any], workdir: Path, report: Report) -> None:
    """A sliding-window hybrid stored and restored with the hybrid manager on and as full
    attention: bytes written, bytes read and restored TTFT each way (module docstring)."""
    from kvcore_vllm.session import MODEL_SIZES, run_in_subprocess, write_model

    model = write_model(REPO / "integrations" / "vllm" / ".cache" / "models" / "swa", "swa")
    size = MODEL_SIZES["swa"]
    rng = random.Random(7)
    prompt = [rng.randrange(1, size["vocab_size"]) for _ in range(HYBRID_PROMPT_TOKENS)]
    first = [rng.randrange(1, size["vocab_size"]) for _ in range(64)]
    warm = {"op": "generate", "name": "warm", "prompts": [first], "max_tokens": 2}
    long = {"op": "generate", "name": "long", "prompts": [prompt], "max_tokens": 8}
    stats = {"op": "log_stats", "name": "stats"}
    engine = {
        **base,
        "model": str(model),
        "max_model_len": size["max_position_embeddings"],
        "kv_cache_bytes": 64 << 20,
        "vocab_size": size["vocab_size"],
    }
    ways = {"hybrid": {}, "full_attention": {"disable_hybrid_kv_cache_manager": True}}
    seen: dict[str, dict[str, list[float]]] = {
        way: {"stored": [], "read": [], "ttft": []} for way in ways
    }
    tokens_match = True
    for rep in range(args.reps):
        order = list(ways) if rep % 2 == 0 else list(reversed(ways))
        for way in order:
            spec = {**engine, **ways[way]}
            connector = {
                "backend": "file",
                "backend_config": {"root": str(workdir / f"hybrid-{way}-{rep}")},
                "namespace": "bench-hybrid",
            }
            fill = run_in_subprocess(
                {**spec, "connector": connector, "steps": [warm, long, stats]},
                workdir,
                f"hybrid-{way}-fill-{rep}",
            )
            restore = run_in_subprocess(
                {**spec, "connector": connector, "steps": [warm, long, stats]},
                workdir,
                f"hybrid-{way}-restore-{rep}",
            )
            seen[way]["stored"].append(fill.step("stats")["metrics"]["save_bytes"])
            seen[way]["read"].append(restore.step("stats")["metrics"]["load_bytes"])
            seen[way]["ttft"].append(restore.step("long")["ttft_s"][0])
            if way == "hybrid":
                tokens_match &= restore.step("long")["tokens"] == fill.step("long")["tokens"]
    for way, got in seen.items():
        report.figure(f"hybrid_swa_{way}_bytes_stored", got["stored"], "B")
        report.figure(f"hybrid_swa_{way}_bytes_read_per_restore", got["read"], "B")
        report.figure(f"hybrid_swa_{way}_ttft_restored_s", got["ttft"], "s")
    hybrid, full = seen["hybrid"], seen["full_attention"]
    report.ratio(
        "hybrid_swa_bytes_read_vs_full_attention", hybrid["read"], full["read"], goal="< 1.0"
    )
    report.ratio("hybrid_swa_bytes_stored_vs_full_attention", hybrid["stored"], full["stored"])
    report.ratio("hybrid_swa_ttft_restored_vs_full_attention", hybrid["ttft"], full["ttft"])
    report.notes["hybrid_model"] = f"random Gemma 3 text: {size}, bfloat16; block 32 tokens"
    report.notes["hybrid_prompt_tokens"] = HYBRID_PROMPT_TOKENS
    report.notes["hybrid_tokens_match"] = tokens_match


def _decode_overhead(
    args: argparse.Namespace, base: dict[str, Any], workdir: Path, report: Report
) -> None:
    """Decode steps of four engines in one process, taking turns on the same prompts: two
    without the connector (A and A': their difference is the noise), one with it, one with it
    and vLLM's KV events on (the store's events built and handed to vLLM's publisher)."""
    spec = {
        **base,
        "connector": {
            "backend": "file",
            "backend_config": {"root": str(workdir / "decode-store")},
            "namespace": "bench",
        },
        "rounds": args.reps * args.decode_prompts,
    }
    steps = _run_child("decode", spec, workdir)
    ms = {label: [v * 1e3 for v in values] for label, values in steps["steps"].items()}
    for label in DECODE_ENGINES:
        report.figure(f"decode_step_{label}_ms", ms[label], "ms")
    report.ratio("decode_step_aa_control", ms["without_again"], ms["without"])
    report.ratio("decode_step_with_vs_without_connector", ms["with"], ms["without"], goal="<= 1.02")
    report.ratio("decode_step_events_vs_no_events", ms["with_events"], ms["with"])
    for label in ("with", "with_events"):
        hooks = steps["hooks"][label]
        n = max(hooks.get("scheduler_steps", 0.0), 1.0)
        hook_ms = hooks.get("scheduler_hook_seconds", 0.0) + hooks.get("worker_hook_seconds", 0.0)
        report.notes[f"connector_hook_ms_per_step_{label}"] = round(hook_ms * 1e3 / n, 4)
        report.notes[f"connector_steps_{label}"] = n
    report.notes["decode_rounds"] = spec["rounds"]


def _run_child(part: str, spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run ``part``'s engines in a child process of their own (``--<part>-child``), its log in
    ``workdir``; the JSON object it prints last."""
    import subprocess

    spec_path = workdir / f"{part}-engines.json"
    spec_path.write_text(json.dumps(spec))
    with open(workdir / f"{part}-engines.log", "w") as log:
        out = subprocess.run(
            [sys.executable, __file__, f"--{part}-child", str(spec_path)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            check=True,
        ).stdout
    return json.loads(out.strip().splitlines()[-1])


#: the decode engines, in the order of the first round (the order rotates every round)
DECODE_ENGINES = ("without", "without_again", "with", "with_events")


def _decode_child(spec_path: str) -> None:
    """Runs in its own process: the decode engines taking turns, and the connector's hook times."""
    import logging

    from kvcore_vllm.session import MetricsCapture, parse_metrics, start_engine
    from vllm import SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    plain = {**spec, "connector": None, "disable_hybrid_kv_cache_manager": True}
    events = {
        **spec,
        "connector": {**spec["connector"], "namespace": "bench-events"},
        "kv_events_endpoint": f"ipc://{Path(spec_path).with_suffix('.events')}",
    }
    engines = {
        "without": start_engine(plain),
        "without_again": start_engine(plain),
        "with": start_engine(spec),
        "with_events": start_engine(events),
    }
    capture = MetricsCapture()
    logging.getLogger("vllm").addHandler(capture)
    params = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True, detokenize=False)
    rng = random.Random(7)
    steps: dict[str, list[float]] = {label: [] for label in DECODE_ENGINES}
    hooks: dict[str, dict[str, float]] = {}
    for label in DECODE_ENGINES:  # warm-up, not measured
        engines[label].generate([{"prompt_token_ids": [5] * 64}], params, use_tqdm=False)
    for i in range(int(spec["rounds"])):
        prompt = [rng.randrange(1, int(spec["vocab_size"])) for _ in range(256)]
        k = i % len(DECODE_ENGINES)
        for label in DECODE_ENGINES[k:] + DECODE_ENGINES[:k]:
            out = engines[label].generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            m = out[0].metrics
            steps[label].append(
                (m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1)
            )
    for label in ("with", "with_events"):
        capture.lines.clear()
        engines[label].llm_engine.do_log_stats()
        hooks[label] = parse_metrics(capture.lines)
    for engine in engines.values():
        engine.llm_engine.engine_core.shutdown()
    print(json.dumps({"steps": steps, "hooks": hooks}), flush=True)


#: the ITL engines, in the order of the first round (the order rotates every round): two
#: without the connector (their stream runs alone), and the connector loading synchronously
#: (inside the step that uses the blocks) and in the background
ITL_ENGINES = ("none", "none_again", "sync", "async")
#: the decode stream: its prompt, the tokens it decodes before the restore request arrives,
#: and all the tokens it decodes (the window is the rest: ITL_STREAM_TOKENS - ITL_STREAM_LEAD)
ITL_STREAM_PROMPT_TOKENS = 64
ITL_STREAM_LEAD = 20
ITL_STREAM_TOKENS = 160
#: the prompt each connector engine restores once before it is measured (4 blocks): the first
#: restore of an engine pays for starting its I/O, which no later one does
ITL_WARM_RESTORE_TOKENS = 128


def _itl(args: argparse.Namespace, base: dict[str, Any], workdir: Path, report: Report) -> None:
    """A decode stream's inter-token latency while another request restores a long stored
    prompt (synchronous and background loads), against the stream alone (module docstring)."""
    rng = random.Random(11)
    vocab = int(base["vocab_size"])
    # one stored prompt per round: no engine ever restores a prompt it has already seen, so
    # the restore can only come from the store, never from vLLM's own prefix cache
    stored = [
        [rng.randrange(1, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.reps)
    ]
    warm_restore = [rng.randrange(1, vocab) for _ in range(ITL_WARM_RESTORE_TOKENS)]
    store_root = workdir / "itl-store"
    connector = {
        "backend": "file",
        "backend_config": {"root": str(store_root)},
        "namespace": "bench-itl",
    }
    spec = {
        **base,
        "connector": connector,
        "store_root": str(store_root),
        "stored": stored,
        "warm_restore": warm_restore,
    }
    got = _run_child("itl", spec, workdir)
    stats = {label: got["rounds"][label] for label in ITL_ENGINES}
    for label in ITL_ENGINES:
        for stat in ("median", "p99", "max"):
            report.figure(f"itl_{label}_{stat}_ms", stats[label][stat], "ms")
    for stat in ("p99", "median"):
        no_restore = stats["none"][stat]
        report.ratio(f"itl_{stat}_aa_control", stats["none_again"][stat], no_restore)
        aa = report.ratios[f"itl_{stat}_aa_control"]
        # "within the A/A control's spread": two engines that differ in nothing may differ by
        # this much either way, so the async path may be as much slower than no restore
        noise = round(max(aa["max"], 1 / aa["min"]), 3)
        report.ratio(
            f"itl_{stat}_async_vs_no_restore",
            stats["async"][stat],
            no_restore,
            goal=f"<= {noise}" if stat == "p99" else None,
        )
        report.ratio(f"itl_{stat}_sync_vs_no_restore", stats["sync"][stat], no_restore)
    # a round's ~140 gaps give a p99 between its 2nd and 3rd largest gap: one long step (a
    # synchronous restore stalls one) shows in the max, which is reported beside it
    report.ratio("itl_max_async_vs_no_restore", stats["async"]["max"], stats["none"]["max"])
    report.ratio("itl_max_sync_vs_no_restore", stats["sync"]["max"], stats["none"]["max"])
    for label in ("sync", "async"):
        report.figure(f"itl_restore_ttft_{label}_s", stats[label]["restore_ttft_s"], "s")
        report.notes[f"itl_restore_cached_tokens_{label}"] = stats[label]["restore_cached_tokens"]
        report.notes[f"itl_restore_in_window_{label}"] = stats[label]["restore_in_window"]
    report.notes["itl_prompt_tokens"] = args.prompt_tokens
    report.notes["itl_stream_tokens"] = ITL_STREAM_TOKENS
    report.notes["itl_window_tokens"] = sorted(
        {n for label in ITL_ENGINES for n in stats[label]["window_tokens"]}
    )


def _evict_from_page_cache(root: Path) -> None:
    """Drop every file under ``root`` from the page cache, so the next read comes from disk
    (``POSIX_FADV_DONTNEED`` on a clean file needs no privileges)."""
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:  # removed or replaced meanwhile: nothing left to evict
                continue
            try:
                os.fdatasync(fd)  # a dirty page stays cached: write it first
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _stream_with_restore(
    llm: Any,
    tag: str,
    stream_prompt: list[int],
    restore_prompt: list[int] | None,
    store_root: Path,
    stream_tokens: int = ITL_STREAM_TOKENS,
) -> dict[str, Any]:
    """Decode ``stream_prompt`` for ``stream_tokens`` tokens, step by step; after
    :data:`ITL_STREAM_LEAD` of them add ``restore_prompt`` (one token) if there is one.

    Returns ``gaps_s``: the time between consecutive stream tokens from the one after the
    restore's arrival to the last; the restore's TTFT and ``num_cached_tokens``.
    """
    from vllm import SamplingParams

    engine = llm.llm_engine
    stream_id, restore_id = f"stream-{tag}", f"restore-{tag}"

    def params(max_tokens: int) -> Any:
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )

    # before the stream starts, for every engine alike: the restore then reads the disk, and
    # no engine's window holds the time evicting takes
    _evict_from_page_cache(store_root)
    engine.add_request(stream_id, {"prompt_token_ids": stream_prompt}, params(stream_tokens))
    produced = 0
    last_token_at = 0.0
    restore_added_at: float | None = None
    restore_token_at: float | None = None
    restore_cached: int | None = None
    stream_done_at = 0.0
    gaps: list[float] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id == stream_id:
                count = len(out.outputs[0].token_ids)
                if count > produced:
                    if restore_added_at is not None:
                        # one gap per token, should a step ever bring more than one
                        gap = (now - last_token_at) / (count - produced)
                        gaps.extend([gap] * (count - produced))
                    produced, last_token_at = count, now
                if out.finished:
                    stream_done_at = now
            elif out.request_id == restore_id and restore_token_at is None:
                # its one output brings its one token (vLLM sends none without a token)
                restore_token_at = now
                restore_cached = int(out.num_cached_tokens or 0)
        if restore_added_at is None and produced >= ITL_STREAM_LEAD:
            restore_added_at = time.perf_counter()
            if restore_prompt is not None:
                engine.add_request(restore_id, {"prompt_token_ids": restore_prompt}, params(1))
    if produced != stream_tokens:
        raise RuntimeError(f"stream {tag}: {produced} tokens of {stream_tokens}")
    if restore_prompt is None:
        return {"gaps_s": gaps}
    if restore_added_at is None or restore_token_at is None:
        raise RuntimeError(f"restore {tag}: no token")
    return {
        "gaps_s": gaps,
        "restore_ttft_s": restore_token_at - restore_added_at,
        "restore_cached": restore_cached,
        # a restore still running when the stream ended overlapped only part of the window
        "restore_in_window": restore_token_at <= stream_done_at,
    }


def _itl_child(spec_path: str) -> None:
    """Runs in its own process: the ITL engines taking turns (see :func:`_itl`)."""
    import statistics

    from kvcore_vllm.session import start_engine
    from vllm import SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    store_root = Path(spec["store_root"])
    plain = {**spec, "connector": None, "disable_hybrid_kv_cache_manager": True}
    engines = {
        "none": start_engine(plain),
        "none_again": start_engine(plain),
        "sync": start_engine({**spec, "connector": {**spec["connector"], "load_mode": "sync"}}),
        "async": start_engine({**spec, "connector": {**spec["connector"], "load_mode": "async"}}),
    }
    restores = {"none": False, "none_again": False, "sync": True, "async": True}
    rng = random.Random(13)
    vocab = int(spec["vocab_size"])
    # the store is filled by the sync engine, which then forgets the prompts (its prefix
    # cache reset): every restore below comes from the store (one engine start fewer than
    # a separate filling engine)
    filler = engines["sync"]
    fill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    prompts = [spec["warm_restore"], *spec["stored"]]
    filler.generate([{"prompt_token_ids": p} for p in prompts], fill, use_tqdm=False)
    # vLLM refuses while the prompts' blocks wait for their saves: until those are stored
    deadline = time.monotonic() + 120
    while not filler.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError("the filling engine's prefix cache could not be reset in 120 s")
        time.sleep(0.1)

    def stream_prompt() -> list[int]:
        # a fresh prompt for every engine and round: the stream is never a hit anywhere (a
        # connector engine would otherwise find the stream an earlier one stored)
        return [rng.randrange(1, vocab) for _ in range(ITL_STREAM_PROMPT_TOKENS)]

    for label in ITL_ENGINES:  # warm-up, not measured: the whole path, a restore included
        restore = spec["warm_restore"] if restores[label] else None
        _stream_with_restore(
            engines[label], "warm", stream_prompt(), restore, store_root, ITL_STREAM_LEAD + 8
        )
    keys = (
        "median",
        "p99",
        "max",
        "window_tokens",
        "restore_ttft_s",
        "restore_cached_tokens",
        "restore_in_window",
    )
    rounds: dict[str, dict[str, list[Any]]] = {
        label: {key: [] for key in keys} for label in ITL_ENGINES
    }
    for i, stored in enumerate(spec["stored"]):
        k = i % len(ITL_ENGINES)
        for label in ITL_ENGINES[k:] + ITL_ENGINES[:k]:
            got = _stream_with_restore(
                engines[label],
                str(i),
                stream_prompt(),
                stored if restores[label] else None,
                store_root,
            )
            gaps_ms = [g * 1e3 for g in got["gaps_s"]]
            seen = rounds[label]
            seen["median"].append(statistics.median(gaps_ms))
            # linear between the two nearest ranks, as numpy.percentile does by default
            seen["p99"].append(statistics.quantiles(gaps_ms, n=100, method="inclusive")[98])
            seen["max"].append(max(gaps_ms))
            seen["window_tokens"].append(len(gaps_ms))
            if restores[label]:
                seen["restore_ttft_s"].append(got["restore_ttft_s"])
                seen["restore_cached_tokens"].append(got["restore_cached"])
                seen["restore_in_window"].append(got["restore_in_window"])
    for engine in engines.values():
        engine.llm_engine.engine_core.shutdown()
    print(json.dumps({"rounds": rounds}), flush=True)


def _mooncake_side_by_side(
    args: argparse.Namespace,
    reference: list[list[int]],
    base: dict[str, Any],
    warm: dict[str, Any],
    long: dict[str, Any],
    workdir: Path,
    report: Report,
) -> str:
    """Restored TTFT of vLLM's MooncakeStoreConnector and of ours on kv_mooncake, one master."""
    from kv_mooncake.testing import MooncakeCluster
    from kvcore_vllm.session import run_in_subprocess

    with MooncakeCluster(storage_bytes=1 << 30) as cluster:
        ours = {
            "backend": "mooncake",
            "backend_config": cluster.config(close_timeout_s=2.0, local_buffer_size=64 << 20),
            "namespace": "bench",
        }
        config_path = workdir / "mooncake-store.json"
        config_path.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": cluster.master.address,
                    "protocol": "tcp",
                    "device_name": "",
                    "mode": "standalone-store",  # the storage node keeps the data
                    "global_segment_size": 0,
                    "local_buffer_size": "64MB",
                }
            )
        )
        theirs = {
            **base,
            "env": {"MOONCAKE_CONFIG_PATH": str(config_path), "MC_TCP_BIND_ADDRESS": "127.0.0.1"},
            "kv_transfer_config": {
                "kv_connector": "MooncakeStoreConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {},
            },
        }
        try:
            run_in_subprocess({**theirs, "steps": [warm, long]}, workdir, "mooncake-store-fill")
        except RuntimeError as exc:
            return f"vLLM's MooncakeStoreConnector did not run here: {str(exc).splitlines()[-1]}"
        run_in_subprocess(
            {**base, "connector": ours, "steps": [warm, long]}, workdir, "kvcore-mooncake-fill"
        )
        # vLLM's connector checks nothing it reads back; kvcore by default stores a digest
        # beside each kv_mooncake block and checks it (verify_blocks="auto"): both are shown
        unverified = {**ours, "transfer": {"verify_blocks": "never"}}
        contenders = {
            "ours": {**base, "connector": ours},
            "ours_unverified": {**base, "connector": unverified},
            "theirs": theirs,
        }
        ttft: dict[str, list[float]] = {label: [] for label in contenders}
        restored: dict[str, list[int]] = {label: [] for label in contenders}
        same = dict.fromkeys(contenders, True)
        for rep in range(args.reps):
            order = list(contenders) if rep % 2 == 0 else list(reversed(contenders))
            for label in order:
                run = run_in_subprocess(
                    {**contenders[label], "steps": [warm, long]}, workdir, f"{label}-mooncake-{rep}"
                )
                ttft[label].append(run.step("long")["ttft_s"][0])
                restored[label].append(run.step("long")["num_cached_tokens"][0])
                same[label] &= run.step("long")["tokens"] == reference
    names = {
        "ours": "kvcore_kv_mooncake",
        "ours_unverified": "kvcore_kv_mooncake_unverified",
        "theirs": "mooncake_store_connector",
    }
    for label, name in names.items():
        report.figure(f"ttft_restored_{name}_s", ttft[label], "s")
        report.notes[f"restored_tokens_{name}"] = restored[label]
    report.ratio(
        "mooncake_store_connector_vs_kvcore_restored_ttft",
        ttft["theirs"],
        ttft["ours"],
        goal=">= 1.0",
    )
    report.ratio(
        "mooncake_store_connector_vs_kvcore_unverified_restored_ttft",
        ttft["theirs"],
        ttft["ours_unverified"],
        goal=">= 1.0",
    )
    return (
        f"tokens match the recomputed engine's: ours {same['ours']}, ours unverified "
        f"{same['ours_unverified']}, MooncakeStoreConnector {same['theirs']}; measured: one master on 127.0.0.1 with a 1 GiB storage node, fresh engine per run"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--decode-child":
        _decode_child(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "--itl-child":
        _itl_child(sys.argv[2])
    else:
        main()
