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
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from kvcore.backend import Backend
from kvcore.cli.common import clear_scratch, data_location, open_for_cli, scratch_namespace
from kvcore.cli.console import CommandConsole, Console, step_progress
from kvcore.cli.errors import ExitCode
from kvcore.errors import ConfigError
from kvcore.keys import KeyScope, block_hashes
from kvcore.metrics import serve_prometheus
from kvcore.schemas import BackendContext, CacheDType, CacheLayout
from kvcore.tasks import TaskResult
from kvcore.transfer import DeviceCache, TransferConfig, TransferManager

LAYOUT = CacheLayout(
    num_layers=12,
    num_heads=8,
    block_size=16,
    head_dim=128,
    dtype=CacheDType.bfloat16,
    num_blocks=384,
)
MAX_MODEL_LEN = 4096
SYSTEM_PROMPT_TOKENS = 256


@dataclass
class Moved:
    """Blocks moved in one direction over the run, and the time the manager reported."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, result: TaskResult) -> None:
        self.blocks += result.num_blocks
        self.bytes += result.bytes
        self.seconds += result.timings_s.get("total", 0.0)

    @property
    def gbps(self) -> float:
        """10^9 bytes per second, as in every kvcore figure."""
        return self.bytes / 1e9 / self.seconds if self.seconds else 0.0


@dataclass
class Totals:
    turns: int = 0
    prompt_tokens: int = 0
    prompt_blocks: int = 0
    blocks_skipped: int = 0
    mismatches: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    read: Moved = field(default_factory=Moved)
    written: Moved = field(default_factory=Moved)


def expected_block(key: str, part: str) -> np.ndarray:
    """The bytes block ``key`` holds for ``part`` (all layers): derived from the key alone."""
    seed = int.from_bytes(
        hashlib.blake2b(f"{key}/{part}".encode(), digest_size=8).digest(), "little"
    )
    return np.random.default_rng(seed).integers(0, 256, LAYOUT.part_bytes(part), dtype=np.uint8)


class Engine:
    """The engine side: per-layer cache arrays, a block allocator, fill and verify.

    numpy has no bfloat16, so the bfloat16 cache is held as uint16 arrays: kvcore moves whole
    blocks and checks only the element size (2 bytes), never the element type.
    """

    def __init__(self) -> None:
        shape = LAYOUT.kv_shape
        self.k = [np.zeros(shape, dtype=np.uint16) for _ in range(LAYOUT.total_layers)]
        self.v = [np.zeros(shape, dtype=np.uint16) for _ in range(LAYOUT.total_layers)]
        self.cache = DeviceCache(LAYOUT, self.k, self.v)
        self.views = {
            "k": [t.view(np.uint8).reshape(LAYOUT.num_blocks, -1) for t in self.k],
            "v": [t.view(np.uint8).reshape(LAYOUT.num_blocks, -1) for t in self.v],
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


@dataclass
class Workload:
    """The conversations: a shared system prompt, then per turn a user message and an answer."""

    seed: int
    conversations: int
    turns: int
    scope: KeyScope = field(default_factory=lambda: KeyScope(model="kvcore-demo"))

    def histories(self) -> dict[int, list[int]]:
        system = conversation_tokens(self.seed, -1, 0, "user", SYSTEM_PROMPT_TOKENS)
        return {c: list(system) for c in range(self.conversations)}


def run_workload(
    tm: TransferManager, engine: Engine, workload: Workload, console: CommandConsole
) -> Totals:
    totals = Totals()
    histories = workload.histories()
    total_turns = workload.conversations * workload.turns
    with step_progress(console.err, "demo", total_turns, "turns") as progress:
        for turn in range(workload.turns):
            for conv in range(workload.conversations):
                histories[conv] = one_turn(
                    tm, engine, workload, totals, histories[conv], turn, conv
                )
                hit = 100 * totals.read.blocks / max(totals.prompt_blocks, 1)
                progress.advance(note=f"hit rate {hit:.1f} %")
    return totals


def one_turn(
    tm: TransferManager,
    engine: Engine,
    workload: Workload,
    totals: Totals,
    history: list[int],
    turn: int,
    conv: int,
) -> list[int]:
    """One turn of one conversation: restore the stored prefix, verify it, compute the rest,
    write it all back. Returns the conversation's tokens after the turn."""
    bs = LAYOUT.block_size
    seed = workload.seed
    rng = np.random.default_rng([seed, conv + 1, turn, 2])
    user = conversation_tokens(seed, conv, turn, "user", int(rng.integers(60, 240)))
    prompt = history + user
    answer = conversation_tokens(seed, conv, turn, "bot", int(rng.integers(40, 160)))
    full = (prompt + answer)[:MAX_MODEL_LEN]
    keys = block_hashes(full, bs, workload.scope)
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
    totals.read.add(res)
    if res.error:
        _error(totals, f"{tid} read: {res.error}")
    for j in range(restored):
        if not engine.verify(ids[j], keys[j]):
            totals.mismatches += 1
    for j in range(restored, len(keys)):  # prefill and decode "compute" the rest
        engine.compute(ids[j], keys[j])

    wres = tm.write_back(
        {"task_id": f"{tid}-write", "keys": keys, "device_block_ids": ids, "token_ids": full}
    ).result()
    totals.written.add(wres)
    totals.blocks_skipped += wres.skipped_blocks
    if wres.error:
        _error(totals, f"{tid} write: {wres.error}")
    totals.turns += 1
    totals.prompt_tokens += len(prompt)
    totals.prompt_blocks += n_prompt
    return full


def _error(totals: Totals, msg: str) -> None:
    totals.errors += 1
    if len(totals.error_samples) < 3:
        totals.error_samples.append(msg)


def summary(
    totals: Totals, backend: Backend, elapsed: float, data: str, staging_bytes: int
) -> dict[str, Any]:
    return {
        "backend": backend.name,
        "namespace": backend.context.namespace,
        "turns": totals.turns,
        "prompt_tokens": totals.prompt_tokens,
        "prompt_blocks": totals.prompt_blocks,
        "hit_rate": totals.read.blocks / max(totals.prompt_blocks, 1),
        "blocks_read": totals.read.blocks,
        "blocks_written": totals.written.blocks,
        "blocks_skipped": totals.blocks_skipped,
        "bytes_read": totals.read.bytes,
        "bytes_written": totals.written.bytes,
        "read_gbps": totals.read.gbps,
        "write_gbps": totals.written.gbps,
        "mismatches": totals.mismatches,
        "errors": totals.errors,
        "error_samples": totals.error_samples,
        "elapsed_s": elapsed,
        "staging_bytes": staging_bytes,
        "data_location": data_location(backend),
        "data": data,
    }


def print_summary(s: dict[str, Any], console: Console) -> None:
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
        ("staging memory", f"{s['staging_bytes'] / mib:.0f} MiB"),
        ("namespace", s["namespace"]),
        ("data", s["data"]),
    ]
    console.print(f"kvcore demo on backend {s['backend']!r}", markup=False)
    width = max(len(name) for name, _ in rows) + 2
    for name, value in rows:  # plain lines: a long value never wraps into the next row
        console.print(f"  {name:<{width}}{value}", markup=False, soft_wrap=True)
    for sample in s["error_samples"]:
        console.print(f"  error: {sample}", markup=False)
    if s["mismatches"]:
        console.print("FAILED: restored bytes differ from what was stored")
    elif s["errors"]:
        console.print(f"FAILED: the backend failed {s['errors']} times (see the errors above)")
    else:
        console.print("OK: every restored byte matched")


def run(args: argparse.Namespace, console: CommandConsole) -> int:
    from kvcore.cli.options import load_config_arg

    config = load_config_arg(args.config)
    namespace = scratch_namespace("demo", args.namespace)
    context = BackendContext(layout=LAYOUT, namespace=namespace)
    try:
        tm_config = TransferConfig.load({
            "layout": LAYOUT,
            "max_model_len": MAX_MODEL_LEN,
            "namespace": namespace,
            "default_timeout_s": 30.0,
        })  # fmt: skip
    except ValidationError as exc:
        raise ConfigError.from_validation("transfer config", exc) from None
    # the environment's KVCORE_TRANSFER_VERIFY_BLOCKS is the opened backend's setting
    backend = open_for_cli(args.backend, config, context, tm_config.verify_blocks)
    workload = Workload(args.seed, args.conversations, args.turns)
    t0 = time.monotonic()
    server = None
    try:
        engine = Engine()
        with TransferManager(tm_config, engine.cache, backend) as tm:
            if args.metrics_port is not None:
                server, _ = serve_prometheus(tm, args.metrics_port)
                console.err.print(
                    f"metrics: http://127.0.0.1:{server.server_port}/metrics", markup=False
                )
            totals = run_workload(tm, engine, workload, console)
            staging = tm.memory_bytes()["staging_bytes"]
        elapsed = time.monotonic() - t0
        data = clear_scratch(backend, args.keep)
    finally:
        if server is not None:
            server.shutdown()
        backend.close()
    s = summary(totals, backend, elapsed, data, staging)
    if args.json:
        console.out.print_json(json.dumps(s))
    else:
        print_summary(s, console.out)
    if totals.mismatches:
        return ExitCode.FAILED
    return ExitCode.BACKEND_FAILED if totals.errors else ExitCode.OK
