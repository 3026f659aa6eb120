"""``kvcore demo``: a multi-turn chat workload through the TransferManager, bytes verified.

Several conversations share a system prompt and grow turn by turn. Each turn queries storage,
restores the stored prefix into fresh device blocks, checks every restored byte, "computes"
the missing blocks (fills them deterministically from their hash) and writes the sequence
back. Block contents depend only on the block key, so a later run - or another process -
can verify what an earlier one stored.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcore.keys import KeyScope, block_hashes
from kvcore.registry import open_backend
from kvcore.schemas import BackendContext, CacheLayout
from kvcore.transfer import DeviceCache, TransferManager

LAYOUT = CacheLayout(
    num_layers=12, num_heads=8, block_size=16, head_dim=128, dtype="bfloat16", num_blocks=384
)
MAX_MODEL_LEN = 4096
SYSTEM_PROMPT_TOKENS = 256


@dataclass
class Totals:
    turns: int = 0
    prompt_tokens: int = 0
    prompt_blocks: int = 0
    blocks_read: int = 0
    blocks_written: int = 0
    blocks_skipped: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    mismatches: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)


def expected_block(key: str, part: str) -> np.ndarray:
    """The bytes block ``key`` holds for ``part`` (all layers): derived from the key alone."""
    seed = int.from_bytes(
        hashlib.blake2b(f"{key}/{part}".encode(), digest_size=8).digest(), "little"
    )
    return np.random.default_rng(seed).integers(0, 256, LAYOUT.part_bytes(part), dtype=np.uint8)


class Engine:
    """The engine side: Paddle cache tensors, a block allocator, fill and verify."""

    def __init__(self) -> None:
        import paddle

        shape = list(LAYOUT.kv_shape)
        self.k = [paddle.zeros(shape, dtype="bfloat16") for _ in range(LAYOUT.total_layers)]
        self.v = [paddle.zeros(shape, dtype="bfloat16") for _ in range(LAYOUT.total_layers)]
        self.cache = DeviceCache(LAYOUT, self.k, self.v)
        self.views = {
            "k": [
                np.from_dlpack(t.view(paddle.uint8)).reshape(LAYOUT.num_blocks, -1) for t in self.k
            ],
            "v": [
                np.from_dlpack(t.view(paddle.uint8)).reshape(LAYOUT.num_blocks, -1) for t in self.v
            ],
        }
        self.rng = np.random.default_rng(1234)

    def allocate(self, n: int) -> list[int]:
        return self.rng.permutation(LAYOUT.num_blocks)[:n].tolist()

    def compute(self, block_id: int, key: str) -> None:
        for part, layers in self.views.items():
            per_layer = expected_block(key, part).reshape(LAYOUT.total_layers, -1)
            for layer, view in enumerate(layers):
                view[block_id] = per_layer[layer]

    def verify(self, block_id: int, key: str) -> bool:
        for part, layers in self.views.items():
            per_layer = expected_block(key, part).reshape(LAYOUT.total_layers, -1)
            if any(
                not np.array_equal(view[block_id], per_layer[i]) for i, view in enumerate(layers)
            ):
                return False
        return True

    def scrub(self, block_ids: list[int]) -> None:
        for layers in self.views.values():
            for view in layers:
                view[block_ids] = 0


def conversation_tokens(seed: int, conv: int, turn: int, kind: str, n: int) -> list[int]:
    rng = np.random.default_rng([seed, conv + 1, turn, 0 if kind == "user" else 1])
    return rng.integers(0, 100_000, n).tolist()


def progress(done: int, total: int, totals: Totals, started: float) -> None:
    """A bar redrawn in place on a terminal; in a log, one line per tenth of the run."""
    tty = sys.stderr.isatty()
    if not tty and done != total and done % max(total // 10, 1):
        return
    width = 30
    filled = width * done // max(total, 1)
    hit = 100 * totals.blocks_read / max(totals.prompt_blocks, 1)
    sys.stderr.write(
        f"{chr(13) if tty else ''}  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
        f"turns, hit rate {hit:5.1f} %, {time.monotonic() - started:5.1f} s"
        + (" " if tty else "\n")
    )
    sys.stderr.flush()


def run_workload(tm: TransferManager, engine: Engine, args: argparse.Namespace) -> Totals:
    totals = Totals()
    scope = KeyScope(model="kvcore-demo", namespace="demo")
    system = conversation_tokens(args.seed, -1, 0, "user", SYSTEM_PROMPT_TOKENS)
    histories = {c: list(system) for c in range(args.conversations)}
    total_turns = args.conversations * args.turns
    started = time.monotonic()
    bs = LAYOUT.block_size
    for turn in range(args.turns):
        for conv in range(args.conversations):
            rng = np.random.default_rng([args.seed, conv + 1, turn, 2])
            user = conversation_tokens(args.seed, conv, turn, "user", int(rng.integers(60, 240)))
            prompt = histories[conv] + user
            answer = conversation_tokens(args.seed, conv, turn, "bot", int(rng.integers(40, 160)))
            full = (prompt + answer)[:MAX_MODEL_LEN]
            keys = block_hashes(full, bs, scope)
            n_prompt = min(len(prompt) // bs, len(keys))
            ids = engine.allocate(len(keys))
            engine.scrub(ids)
            tid = f"c{conv}t{turn}"

            res = tm.read(
                {
                    "task_id": f"{tid}-read",
                    "keys": keys[:n_prompt],
                    "device_block_ids": ids[:n_prompt],
                    "token_ids": full,
                }
            ).result()
            restored = res.num_blocks
            totals.read_s += res.timings_s.get("total", 0.0)
            totals.bytes_read += res.bytes
            totals.blocks_read += restored
            if res.error:
                _error(totals, f"{tid} read: {res.error}")
            for j in range(restored):
                if not engine.verify(ids[j], keys[j]):
                    totals.mismatches += 1
            for j in range(restored, len(keys)):  # prefill and decode "compute" the rest
                engine.compute(ids[j], keys[j])

            wres = tm.write_back(
                {
                    "task_id": f"{tid}-write",
                    "keys": keys,
                    "device_block_ids": ids,
                    "token_ids": full,
                }
            ).result()
            totals.write_s += wres.timings_s.get("total", 0.0)
            totals.blocks_written += wres.num_blocks
            totals.blocks_skipped += wres.skipped_blocks
            totals.bytes_written += wres.bytes
            if wres.error:
                _error(totals, f"{tid} write: {wres.error}")
            totals.turns += 1
            totals.prompt_tokens += len(prompt)
            totals.prompt_blocks += n_prompt
            histories[conv] = full
            progress(totals.turns, total_turns, totals, started)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    return totals


def _error(totals: Totals, msg: str) -> None:
    totals.errors += 1
    if len(totals.error_samples) < 3:
        totals.error_samples.append(msg)


def where_data_lives(backend: Any) -> str:
    root = getattr(backend.config, "root", None)
    if root is not None:
        return str(root)
    # the settings that say where the data is: whatever was set, secrets left out
    shown = {
        k: v
        for k, v in backend.config.model_dump(mode="json", exclude_defaults=True).items()
        if "password" not in k and "secret" not in k
    }
    return f"backend {backend.name!r} ({json.dumps(shown)})"


def summary(totals: Totals, backend: Any, elapsed: float) -> dict[str, Any]:
    gib = 1024**3
    return {
        "backend": backend.name,
        "turns": totals.turns,
        "prompt_tokens": totals.prompt_tokens,
        "prompt_blocks": totals.prompt_blocks,
        "hit_rate": totals.blocks_read / max(totals.prompt_blocks, 1),
        "blocks_read": totals.blocks_read,
        "blocks_written": totals.blocks_written,
        "blocks_skipped": totals.blocks_skipped,
        "bytes_read": totals.bytes_read,
        "bytes_written": totals.bytes_written,
        "read_gbps": totals.bytes_read / gib / totals.read_s if totals.read_s else 0.0,
        "write_gbps": totals.bytes_written / gib / totals.write_s if totals.write_s else 0.0,
        "mismatches": totals.mismatches,
        "errors": totals.errors,
        "error_samples": totals.error_samples,
        "elapsed_s": elapsed,
        "data_location": where_data_lives(backend),
    }


def print_table(s: dict[str, Any]) -> None:
    mib = 1024**2
    rows = [
        ("turns", f"{s['turns']}"),
        ("prompt tokens", f"{s['prompt_tokens']}"),
        ("storage hit rate", f"{100 * s['hit_rate']:.1f} % of prompt blocks restored"),
        ("blocks read", f"{s['blocks_read']}"),
        ("blocks written", f"{s['blocks_written']} (+{s['blocks_skipped']} already stored)"),
        ("bytes read", f"{s['bytes_read'] / mib:.1f} MiB"),
        ("bytes written", f"{s['bytes_written'] / mib:.1f} MiB"),
        ("read GB/s", f"{s['read_gbps']:.2f}"),
        ("write GB/s", f"{s['write_gbps']:.2f}"),
        ("byte mismatches", f"{s['mismatches']}"),
        ("errors", f"{s['errors']}"),
        ("elapsed", f"{s['elapsed_s']:.1f} s"),
        ("data lives in", s["data_location"]),
    ]
    print(f"kvcore demo on backend {s['backend']!r}")
    for name, value in rows:
        print(f"  {name:18} {value}")
    for sample in s["error_samples"]:
        print(f"  error: {sample}")
    if s["mismatches"]:
        print("FAILED: restored bytes differ from what was stored")
    else:
        print("OK: every restored byte matched")


def run(args: argparse.Namespace) -> int:
    from kvcore.cli import load_config_arg

    config = load_config_arg(args.config)
    context = BackendContext(layout=LAYOUT, namespace="kvcore-demo")
    backend = open_backend(args.backend, config, context=context)
    engine = Engine()
    tm_config = {
        "layout": LAYOUT,
        "max_model_len": MAX_MODEL_LEN,
        "namespace": "kvcore-demo",
        "default_timeout_s": 30.0,
    }
    t0 = time.monotonic()
    try:
        with TransferManager(tm_config, engine.cache, backend) as tm:
            totals = run_workload(tm, engine, args)
    finally:
        backend.close()
    s = summary(totals, backend, time.monotonic() - t0)
    if args.json:
        print(json.dumps(s))
    else:
        print_table(s)
    return 2 if totals.mismatches else 0
