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
- **Per-step overhead when nothing is stored**: two engines in one process, one without the
  connector and one with it (kv_file, empty store), take turns on the same fresh 256-token
  prompts (every lookup misses; their new blocks are saved), 65 tokens each; a decode step is
  vLLM's (last - first token time) / 64. Goal: the connector's engine at most 2 % slower per
  step. Beside it, the connector's own time on vLLM's step path (its hook calls, measured
  inside the engine) per step, as a fraction of the step: what the A/B difference is made of,
  resolved far below the A/B's noise.
- **vLLM's MooncakeStoreConnector vs KVCoreConnector on kv_mooncake**: the same master (with a
  storage node holding the data, ``standalone-store`` mode for vLLM's connector), the same
  prompt, each restoring into a fresh engine; ratio = MooncakeStoreConnector's restored TTFT
  over ours (goal >= 1.0: ours is no slower). Ours twice: as configured by default (a digest
  object beside each block, checked on every read: kv_mooncake keeps no checksum) and with
  ``verify_blocks="never"``, which checks as little as vLLM's connector does.

Contenders alternate within every repetition; figures are medians (ranges beside them).
One JSON object on stdout. Needs vLLM: run it with integrations/vllm/.venv/bin/python (created
by integrations/vllm/scripts/test.sh); another Python re-executes itself with that one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / "integrations" / "vllm" / ".venv" / "bin" / "python"


def _python_with_vllm() -> None:
    """Re-execute with the vLLM venv's Python when this one cannot import vLLM."""
    import importlib.util

    # found, not imported: importing vLLM starts threads, and the network namespace below
    # must be entered before any thread exists
    if not (importlib.util.find_spec("vllm") and importlib.util.find_spec("kvcore_vllm")):
        if VLLM_PYTHON.exists() and Path(sys.executable).resolve() != VLLM_PYTHON.resolve():
            os.execv(str(VLLM_PYTHON), [str(VLLM_PYTHON), __file__, *sys.argv[1:]])
        sys.exit(
            "bench_vllm needs vLLM and kvcore-vllm: run integrations/vllm/scripts/test.sh once "
            f"to create {VLLM_PYTHON}"
        )


def _median_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="(the output is always JSON)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each contender")
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--decode-prompts", type=int, default=4, help="per rep and engine")
    ap.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake comparison")
    ap.add_argument("--workdir", default=None, help="stores and logs (default: a temp dir)")
    args = ap.parse_args()

    _python_with_vllm()
    from kv_mooncake.testing import isolate_loopback

    # Mooncake clients listen on the wildcard address: keep them on loopback when we can
    netns = isolate_loopback()
    from kvcore_vllm.session import run_in_subprocess, write_model

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = write_model(REPO / "integrations" / "vllm" / ".cache" / "models" / "bench", "bench")
    rng = random.Random(42)
    vocab = 4096
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
        "max_model_len": 8192,
        "kv_cache_bytes": 1 << 30,
        "log_stats": True,
    }

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
        plain = run_in_subprocess(
            {**base, "connector": None, "steps": [warm, long]}, workdir, f"recompute-{rep}"
        )
        restored = run_in_subprocess(
            {**base, "connector": file_connector, "steps": [warm, long]},
            workdir,
            f"restore-file-{rep}",
        )
        reference = plain.step("long")["tokens"]
        ttft["recomputed"].append(plain.step("long")["ttft_s"][0])
        ttft["restored_file"].append(restored.step("long")["ttft_s"][0])
        restored_tokens.append(restored.step("long")["num_cached_tokens"][0])
        tokens_match &= restored.step("long")["tokens"] == reference

    figures: dict[str, float] = {}
    for name, values in (
        ("ttft_recomputed_s", ttft["recomputed"]),
        ("ttft_restored_kv_file_s", ttft["restored_file"]),
    ):
        med, lo, hi = _median_range(values)
        figures[name], figures[f"{name}_min"], figures[f"{name}_max"] = med, lo, hi
    figures["prompt_tokens"] = args.prompt_tokens
    figures["restored_tokens"] = statistics.median(restored_tokens)
    ratios = {
        "ttft_restored_vs_recomputed": figures["ttft_restored_kv_file_s"]
        / figures["ttft_recomputed_s"],
    }
    goals = {"ttft_restored_vs_recomputed": "<= 0.25"}
    _decode_overhead(args, base, workdir, figures, ratios, goals)
    mooncake_note = "skipped (--no-mooncake)"
    if not args.no_mooncake:
        mooncake_note = _mooncake_side_by_side(
            args, reference, base, warm, long, workdir, figures, ratios, goals
        )

    report = {
        "figures": {k: round(v, 4) for k, v in sorted(figures.items())},
        "ratios": {k: round(v, 4) for k, v in ratios.items()},
        "goals": goals,
        "tokens_match": tokens_match,
        "units": "s = seconds (vLLM's first-token latency), ms = milliseconds per decode step, "
        "tokens = prompt tokens",
        "model": "random Llama, 8 layers, hidden 1024, 16 q / 8 kv heads x 64, MLP 2816, vocab "
        "4096, ~0.1 B params, bfloat16; block 32 tokens",
        "mooncake": mooncake_note,
        "network_namespace": "private loopback" if netns is None else f"shared ({netns})",
        "repeats": args.reps,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
    }
    print(json.dumps(report))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


def _decode_overhead(
    args: argparse.Namespace,
    base: dict[str, Any],
    workdir: Path,
    figures: dict[str, float],
    ratios: dict[str, float],
    goals: dict[str, str],
) -> None:
    """Decode step time with and without the connector: two engines, one process, turns."""
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
    spec_path = workdir / "decode-pair.json"
    spec_path.write_text(json.dumps(spec))
    with open(workdir / "decode-pair.log", "w") as log:
        out = subprocess.run(
            [sys.executable, __file__, "--pair-child", str(spec_path)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            check=True,
        ).stdout
    pair = json.loads(out.strip().splitlines()[-1])
    for label, name in (("without", "without_connector"), ("with", "with_connector")):
        med, lo, hi = _median_range([v * 1e3 for v in pair[label]])
        key = f"decode_step_{name}_ms"
        figures[key], figures[f"{key}_min"], figures[f"{key}_max"] = med, lo, hi
    hooks = pair["hooks"]
    steps = max(hooks.get("scheduler_steps", 0.0), 1.0)
    hook_s = hooks.get("scheduler_hook_seconds", 0.0) + hooks.get("worker_hook_seconds", 0.0)
    figures["connector_hook_time_per_step_ms"] = hook_s * 1e3 / steps
    figures["connector_steps_measured"] = steps
    without = figures["decode_step_without_connector_ms"]
    ratios["connector_decode_step_overhead"] = (
        figures["decode_step_with_connector_ms"] / without - 1.0
    )
    ratios["connector_hook_time_vs_decode_step"] = (
        figures["connector_hook_time_per_step_ms"] / without
    )
    goals["connector_decode_step_overhead"] = "<= 0.02"
    goals["connector_hook_time_vs_decode_step"] = "<= 0.02"


def _pair_child(spec_path: str) -> None:
    """Runs in its own process: both engines, alternating, and the connector's hook times."""
    import logging

    from kvcore_vllm.session import MetricsCapture, parse_metrics, start_engine
    from vllm import SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    plain = {**spec, "connector": None, "disable_hybrid_kv_cache_manager": True}
    engines = {"without": start_engine(plain), "with": start_engine(spec)}
    capture = MetricsCapture()
    logging.getLogger("vllm").addHandler(capture)
    params = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True, detokenize=False)
    rng = random.Random(7)
    steps: dict[str, list[float]] = {"without": [], "with": []}
    for label in ("without", "with"):  # warm-up, not measured
        engines[label].generate([{"prompt_token_ids": [5] * 64}], params, use_tqdm=False)
    engines["with"].llm_engine.do_log_stats()
    capture.lines.clear()
    for i in range(int(spec["rounds"])):
        prompt = [rng.randrange(1, 4096) for _ in range(256)]
        order = ("without", "with") if i % 2 == 0 else ("with", "without")
        for label in order:
            out = engines[label].generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            m = out[0].metrics
            steps[label].append(
                (m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1)
            )
    engines["with"].llm_engine.do_log_stats()
    hooks = parse_metrics(capture.lines)
    for engine in engines.values():
        engine.llm_engine.engine_core.shutdown()
    print(json.dumps({**steps, "hooks": hooks}), flush=True)


def _mooncake_side_by_side(
    args: argparse.Namespace,
    reference: list[list[int]],
    base: dict[str, Any],
    warm: dict[str, Any],
    long: dict[str, Any],
    workdir: Path,
    figures: dict[str, float],
    ratios: dict[str, float],
    goals: dict[str, str],
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
        med, lo, hi = _median_range(ttft[label])
        key = f"ttft_restored_{name}_s"
        figures[key], figures[f"{key}_min"], figures[f"{key}_max"] = med, lo, hi
        figures[f"restored_tokens_{name}"] = statistics.median(restored[label])
    theirs_s = figures["ttft_restored_mooncake_store_connector_s"]
    ratios["mooncake_store_connector_vs_kvcore_restored_ttft"] = (
        theirs_s / figures["ttft_restored_kvcore_kv_mooncake_s"]
    )
    ratios["mooncake_store_connector_vs_kvcore_unverified_restored_ttft"] = (
        theirs_s / figures["ttft_restored_kvcore_kv_mooncake_unverified_s"]
    )
    goals["mooncake_store_connector_vs_kvcore_restored_ttft"] = ">= 1.0"
    goals["mooncake_store_connector_vs_kvcore_unverified_restored_ttft"] = ">= 1.0"
    return (
        f"tokens match the recomputed engine's: ours {same['ours']}, ours unverified "
        f"{same['ours_unverified']}, MooncakeStoreConnector {same['theirs']}; measured: one master on 127.0.0.1 with a 1 GiB storage node, fresh engine per run"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--pair-child":
        _pair_child(sys.argv[2])
    else:
        main()
