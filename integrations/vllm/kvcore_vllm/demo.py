"""Two vLLM engine processes, one kv_file store: the second restores what the first computed.

    python -m kvcore_vllm.demo [--root DIR] [--prompt-tokens 600] [--keep]

Writes a tiny random Llama (nothing is downloaded), starts an engine with KVCoreConnector on
kv_file and serves one prompt (computed, then stored), exits, starts a *fresh* engine process
on the same store and serves the same prompt again. Prints how many prompt tokens the second
engine restored and whether its greedy tokens match the first's. Exit status 0 when they match
and something was restored.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from pathlib import Path

from kvcore_vllm.session import run_in_subprocess, write_model

BLOCK_SIZE = 32


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvcore_vllm.demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--root", help="kv_file store directory (default: a temporary one)")
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--keep", action="store_true", help="keep the store and the logs")
    args = parser.parse_args(argv)
    if args.prompt_tokens < BLOCK_SIZE + 1:
        parser.error(f"--prompt-tokens must be at least {BLOCK_SIZE + 1} (one full block)")

    workdir = Path(tempfile.mkdtemp(prefix="kvcore-vllm-demo-"))
    root = Path(args.root) if args.root else workdir / "store"
    print(f"model: tiny random Llama (written to {workdir / 'model'})")
    model = write_model(workdir / "model", "tiny")
    prompt = [random.Random(7).randrange(1, 512) for _ in range(args.prompt_tokens)]
    spec = {
        "model": str(model),
        "block_size": BLOCK_SIZE,
        "connector": {
            "backend": "file",
            "backend_config": {"root": str(root)},
            "namespace": "demo",
        },
        "steps": [
            {"op": "generate", "name": "p", "prompts": [prompt], "max_tokens": args.new_tokens}
        ],
    }
    try:
        first = run_in_subprocess(spec, workdir, "engine1").step("p")
        print(
            f"engine 1 (pid gone now): {args.prompt_tokens}-token prompt, "
            f"{first['num_cached_tokens'][0]} tokens from cache, {first['seconds']:.2f} s; "
            f"its blocks are stored in {root}"
        )
        second = run_in_subprocess(spec, workdir, "engine2").step("p")
        restored = second["num_cached_tokens"][0]
        same = second["tokens"] == first["tokens"]
        print(
            f"engine 2 (fresh process): restored {restored} of {args.prompt_tokens} prompt "
            f"tokens from kv_file ({restored // BLOCK_SIZE} blocks of {BLOCK_SIZE}), "
            f"{second['seconds']:.2f} s"
        )
        print(f"tokens identical: {'yes' if same else 'NO'}")
        print(f"  engine 1: {first['tokens'][0]}")
        print(f"  engine 2: {second['tokens'][0]}")
    finally:
        if args.keep:
            print(f"kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0 if same and restored > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
