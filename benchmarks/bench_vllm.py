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

Contenders alternate within every repetition; figures and per-repetition paired ratios are
reported as median, min and max. ``--only`` picks parts (ttft, decode, mooncake, hybrid). With ``--json``,
one JSON object on stdout; else a table. Needs vLLM: run it with integrations/vllm/.venv/bin/python (created
by integrations/vllm/scripts/test.sh); another Python re-executes itself with that one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import Report, emit  # noqa: E402

VLLM_VENV = REPO / "integrations" / "vllm" / ".venv"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"


def _python_with_vllm() -> None:
    """Re-execute with the vLLM venv's Python when this one cannot import vLLM."""
    import importlib.util

    # found, not imported: importing vLLM starts threads, and the network namespace below
    # must be entered before any thread exists
    if not (importlib.util.find_spec("vllm") and importlib.util.find_spec("kvcore_vllm")):
        # venvs' pythons are symlinks to one interpreter: compare the environments, not them
        if VLLM_PYTHON.exists() and Path(sys.prefix).resolve() != VLLM_VENV.resolve():
            os.execv(str(VLLM_PYTHON), [str(VLLM_PYTHON), __file__, *sys.argv[1:]])
        sys.exit(
            "bench_vllm needs vLLM and kvcore-vllm: run integrations/vllm/scripts/test.sh once "
            f"to create {VLLM_PYTHON}"
        )


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
        default="ttft,decode,mooncake,hybrid",
        help="parts to run, comma-separated: ttft, decode, mooncake, hybrid (default: all)",
    )
    args = ap.parse_args()
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    if not parts or parts - {"ttft", "decode", "mooncake", "hybrid"}:
        ap.error(f"--only {args.only!r}: expected some of ttft, decode, mooncake, hybrid")
    if args.no_mooncake:
        parts.discard("mooncake")
    if "mooncake" in parts:
        parts.add("ttft")  # the Mooncake restores are checked against the recomputed tokens

    _python_with_vllm()
    omp_cores = _same_cores_for_every_engine()  # before any engine starts: they inherit it
    from kv_mooncake.testing import isolate_loopback

    # Mooncake clients listen on the wildcard address: keep them on loopback when we can
    netns = isolate_loopback()
    from kvcore_vllm.session import MODEL_SIZES, write_model

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = write_model(
        REPO / "integrations" / "vllm" / ".cache" / "models" / args.model, args.model
    )
    size = MODEL_SIZES[args.model]
    if "ttft" in parts and args.prompt_tokens >= size["max_position_embeddings"]:
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
    tokens_match = True
    reference: list[list[int]] = []
    for rep in range(args.reps):
        runs = {}
        order = ("recompute", "restore") if rep % 2 == 0 else ("restore", "recompute")
        for what in order:
            connector = None if what == "recompute" else file_connector
            runs[what] = run_in_subprocess(
                {**base, "connector": connector, "steps": [warm, long]}, workdir, f"{what}-{rep}"
            )
        plain, restored = runs["recompute"], runs["restore"]
        reference = plain.step("long")["tokens"]
        ttft["recomputed"].append(plain.step("long")["ttft_s"][0])
        ttft["restored_file"].append(restored.step("long")["ttft_s"][0])
        restored_tokens.append(restored.step("long")["num_cached_tokens"][0])
        tokens_match &= restored.step("long")["tokens"] == reference
    report.figure("ttft_recomputed_s", ttft["recomputed"], "s")
    report.figure("ttft_restored_kv_file_s", ttft["restored_file"], "s")
    report.ratio(
        "ttft_restored_vs_recomputed", ttft["restored_file"], ttft["recomputed"], goal="<= 0.25"
    )
    report.notes["prompt_tokens"] = args.prompt_tokens
    report.notes["restored_tokens"] = restored_tokens
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
    import subprocess

    spec = {
        **base,
        "connector": {
            "backend": "file",
            "backend_config": {"root": str(workdir / "decode-store")},
            "namespace": "bench",
        },
        "rounds": args.reps * args.decode_prompts,
    }
    spec_path = workdir / "decode-engines.json"
    spec_path.write_text(json.dumps(spec))
    with open(workdir / "decode-engines.log", "w") as log:
        out = subprocess.run(
            [sys.executable, __file__, "--decode-child", str(spec_path)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            check=True,
        ).stdout
    steps = json.loads(out.strip().splitlines()[-1])
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
    else:
        main()
