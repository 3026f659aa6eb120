"""KVCoreConnector on the real vLLM engine (CPU), over kv_file, kv_mooncake and ``memory``.

For each backend, an engine stores prompt A; a *fresh* engine process then serves A (restored
blocks), B (shares A's first 500 tokens) and a second chat turn of A (its generated tokens'
block is restored too), each from an empty vLLM prefix cache, and its tokens are compared
with an engine that has no connector. The ``memory`` backend keeps its data inside one
process, so its "fresh engine" is the same engine after ``reset_prefix_cache``.

Failures cost recomputation only: a bit-flipped kv_file object, a Mooncake master killed
mid-run and a Mooncake master that is not there at start-up all leave the tokens identical,
and the failures show up in the counters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import BLOCK_SIZE, EngineRun, Prompts, chat_steps, favour_mooncake, run_engine

BACKENDS = ["file", "mooncake", "memory"]

#: A's blocks restored by the fresh engine: (600 - 1) // 32 (vLLM computes the last token)
A_BLOCKS = (600 - 1) // BLOCK_SIZE
#: blocks of A's sequence stored by the first engine: 600 prompt + 40 generated, 639 computed
A_STORED_BLOCKS = (600 + 40 - 1) // BLOCK_SIZE


@dataclass
class BackendRuns:
    backend: str
    store: EngineRun | None  # None for memory: one process does both
    restore: EngineRun
    store_root: str | None = None


def _stats_steps(name: str) -> list[dict[str, Any]]:
    return [{"op": "log_stats", "name": name}]


def _corrupt_steps(prompts: Prompts, flip: str, args: dict[str, Any]) -> list[dict[str, Any]]:
    """Flip a bit of block 9 of A in the store, run A again (its blocks from 9 on must be
    recomputed: same tokens), then once more (healed: every block restored)."""
    return [
        {"op": "call", "target": flip, "args": {**args, "prompt": prompts.a, "block": 9}},
        {"op": "reset_prefix_cache"},
        {"op": "generate", "name": "A_corrupt", "prompts": [prompts.a], "max_tokens": 40},
        *_stats_steps("fail_stats"),
        {"op": "reset_prefix_cache"},
        {"op": "generate", "name": "A_healed", "prompts": [prompts.a], "max_tokens": 40},
        *_stats_steps("heal_stats"),
    ]


def _file_runs(workdir: Path, model: str, prompts: Prompts) -> BackendRuns:
    root = str(workdir / "store")
    connector = {"backend": "file", "backend_config": {"root": root}, "namespace": "vllm-test"}
    # the storing engine: scheduler and worker in separate processes, loaded by module path
    store = run_engine(
        {
            "model": model,
            "connector": connector,
            "executor": "mp",
            "via": "module_path",
            "steps": chat_steps(prompts)[:1],
        },
        workdir,
        "file-store",
    )
    failures = _corrupt_steps(prompts, "engine_helpers:flip_bit_in_file_store", {"root": root})
    restore = run_engine(
        {
            "model": model,
            "connector": connector,
            "in_process": True,
            "steps": [
                *chat_steps(prompts),
                *_stats_steps("stats"),
                *failures,
                {"op": "shutdown", "store_root": root},
            ],
        },
        workdir,
        "file-restore",
    )
    return BackendRuns("file", store, restore, root)


def _mooncake_runs(workdir: Path, model: str, prompts: Prompts) -> BackendRuns:
    from kv_mooncake.testing import MooncakeCluster

    with MooncakeCluster(storage_bytes=256 << 20) as cluster:
        backend_config = favour_mooncake(cluster)
        connector = {"backend": "mooncake", "backend_config": backend_config, "namespace": "vt"}
        store = run_engine(
            {
                "model": model,
                "connector": connector,
                "executor": "mp",
                "steps": chat_steps(prompts)[:1],
            },
            workdir,
            "mooncake-store",
        )
        assert cluster.master.process is not None
        failures = [
            *_corrupt_steps(prompts, "engine_helpers:flip_bit_in_store", {}),
            {
                "op": "call",
                "target": "engine_helpers:kill",
                "args": {"pid": cluster.master.process.pid},
            },
            {"op": "reset_prefix_cache"},
            {"op": "generate", "name": "A_dead", "prompts": [prompts.a], "max_tokens": 40},
            *_stats_steps("dead_stats"),
        ]
        restore = run_engine(
            {
                "model": model,
                "connector": connector,
                "in_process": True,
                "steps": [
                    *chat_steps(prompts),
                    *_stats_steps("stats"),
                    *failures,
                    {"op": "shutdown"},
                ],
            },
            workdir,
            "mooncake-restore",
        )
        # a storage node closes in ~1 s with a live master, ~19 s without one
        cluster.master.start()
    return BackendRuns("mooncake", store, restore)


def _memory_runs(workdir: Path, model: str, prompts: Prompts) -> BackendRuns:
    connector = {"backend": "memory", "namespace": "vllm-test"}
    store_a = {"op": "generate", "name": "store", "prompts": [prompts.a], "max_tokens": 40}
    restore = run_engine(
        {
            "model": model,
            "connector": connector,
            "in_process": True,
            "steps": [
                store_a,
                {"op": "reset_prefix_cache"},
                *chat_steps(prompts),
                *_stats_steps("stats"),
                *_corrupt_steps(prompts, "engine_helpers:flip_bit_in_store", {}),
                # the check that the comparisons above can fail: garbage KV changes the tokens
                {
                    "op": "call",
                    "name": "scramble",
                    "target": "engine_helpers:scramble_memory_store",
                },
                {"op": "reset_prefix_cache"},
                {"op": "generate", "name": "A_scrambled", "prompts": [prompts.a], "max_tokens": 40},
                {"op": "shutdown"},
            ],
        },
        workdir,
        "memory",
    )
    return BackendRuns("memory", None, restore)


@pytest.fixture(scope="module", params=BACKENDS)
def runs(
    request: pytest.FixtureRequest,
    model_dir: Path,
    prompts: Prompts,
    baseline: EngineRun,
    tmp_path_factory: pytest.TempPathFactory,
) -> BackendRuns:
    workdir = tmp_path_factory.mktemp(f"engine-{request.param}")
    build = {"file": _file_runs, "mooncake": _mooncake_runs, "memory": _memory_runs}
    return build[request.param](workdir, str(model_dir), prompts)


def _close_report(run: EngineRun) -> tuple[dict[str, float], dict[str, float]]:
    """The connector's totals and the backend's counters from its close log line."""
    line = next(x for x in run.log.splitlines() if "KVCoreConnector rank 0 closed; totals" in x)
    totals, backend = line.split("; totals ", 1)[1].split("; backend ", 1)
    return json.loads(totals), json.loads(backend)


def _tokens(run: EngineRun, name: str) -> list[list[int]]:
    return run.step(name)["tokens"]


def test_storing_engine_is_unchanged_by_the_connector(
    runs: BackendRuns, baseline: EngineRun
) -> None:
    stored = runs.store.step("A") if runs.store is not None else runs.restore.step("store")
    assert stored["num_cached_tokens"] == [0]
    assert stored["tokens"] == _tokens(baseline, "A")


def test_fresh_engine_restores_the_stored_full_blocks(
    runs: BackendRuns, baseline: EngineRun
) -> None:
    a = runs.restore.step("A")
    assert a["num_cached_tokens"] == [A_BLOCKS * BLOCK_SIZE]
    assert a["tokens"] == _tokens(baseline, "A")


def test_shared_prefix_restores_exactly_the_shared_blocks(
    runs: BackendRuns, baseline: EngineRun, prompts: Prompts
) -> None:
    b = runs.restore.step("B")
    assert prompts.shared_full_blocks == 15
    assert b["num_cached_tokens"] == [prompts.shared_full_blocks * BLOCK_SIZE]
    assert b["tokens"] == _tokens(baseline, "B")


def test_blocks_of_generated_tokens_are_restored(runs: BackendRuns, baseline: EngineRun) -> None:
    t2 = runs.restore.step("T2")
    assert t2["prompt_lengths"] == [690]
    assert t2["num_cached_tokens"] == [A_STORED_BLOCKS * BLOCK_SIZE]
    assert t2["tokens"] == _tokens(baseline, "T2")


def test_kvcore_counters_reach_vllm_stats(runs: BackendRuns, prompts: Prompts) -> None:
    metrics = runs.restore.step("stats")["metrics"]
    restored = A_BLOCKS + prompts.shared_full_blocks + A_STORED_BLOCKS
    assert metrics["lookup_hit_blocks"] == restored
    assert metrics["load_done_blocks"] == restored
    assert metrics.get("load_failed_blocks", 0) == 0
    assert metrics["load_bytes"] > 0
    # kvcore's own TransferManager and backend-facade counters, as vLLM logged them
    assert metrics["kvcore.tm.hits.read"] == restored
    assert metrics["kvcore.be.blocks_done.read"] == restored
    # backends that keep no checksum (memory, Mooncake) also read each block's digest object,
    # counted apart (kvcore.integrity)
    digests = 0 if runs.backend == "file" else restored
    assert metrics.get("kvcore.be.blocks_done.read_digests", 0) == digests
    assert metrics.get("kvcore.be.errors.read", 0) == 0


def test_close_leaves_no_thread_or_file(runs: BackendRuns) -> None:
    closed = runs.restore.step("shutdown")
    assert closed["kvcore_threads"] == []
    assert closed["store_files_open"] == []
    assert "KVCoreConnector rank 0 closed; totals" in runs.restore.log


def test_corrupt_object_costs_recomputation_and_is_healed(
    runs: BackendRuns, baseline: EngineRun
) -> None:
    """kv_file checks its own checksums; memory and Mooncake keep none, so kvcore's block
    digests check what they return: on every backend a flipped bit costs recomputation."""
    assert _tokens(runs.restore, "A_corrupt") == _tokens(baseline, "A")
    failed = runs.restore.step("fail_stats")["metrics"]
    # block 9 failed its check: blocks 9 .. 17 were reported to vLLM and recomputed
    assert failed["load_failed_blocks"] == A_BLOCKS - 9
    assert failed["load_done_blocks"] == 9
    # the corrupt object was dropped and the recomputed blocks were saved again
    healed = runs.restore.step("A_healed")
    assert healed["num_cached_tokens"] == [A_BLOCKS * BLOCK_SIZE]
    assert healed["tokens"] == _tokens(baseline, "A")
    assert runs.restore.step("heal_stats")["metrics"].get("load_failed_blocks", 0) == 0


def test_master_killed_mid_run_costs_recomputation(runs: BackendRuns, baseline: EngineRun) -> None:
    if runs.backend != "mooncake":
        pytest.skip("a Mooncake master is what dies here")
    assert _tokens(runs.restore, "A_dead") == _tokens(baseline, "A")
    assert runs.restore.step("A_dead")["num_cached_tokens"] == [0]
    failed = runs.restore.step("dead_stats")["metrics"]
    assert failed.get("lookup_hit_blocks", 0) == 0
    # the failures are counted: the saves that could not reach the store, and kv_mooncake's
    # own RPC-failure counter, as the connector logs them at close
    totals, backend = _close_report(runs.restore)
    assert totals["save_failed_blocks"] >= 1
    assert backend["backend_miss_rpc_failed"] >= 1


def test_no_master_at_start_costs_recomputation(
    model_dir: Path, prompts: Prompts, baseline: EngineRun, tmp_path: Path
) -> None:
    from kv_mooncake.testing import free_port

    config = {
        "master_server_address": f"127.0.0.1:{free_port()}",
        "master_metrics_port": free_port(),
        "global_segment_size": 0,
        "connect_timeout_s": 1.0,
    }
    run = run_engine(
        {
            "model": str(model_dir),
            "connector": {"backend": "mooncake", "backend_config": config},
            "in_process": True,
            "steps": [
                {"op": "generate", "name": "A", "prompts": [prompts.a], "max_tokens": 40},
                *_stats_steps("stats"),
            ],
        },
        tmp_path,
        "mooncake-no-master",
    )
    a = run.step("A")
    assert a["num_cached_tokens"] == [0]
    assert a["tokens"] == _tokens(baseline, "A")
    metrics = run.step("stats")["metrics"]
    assert metrics["lookup_errors"] >= 1
    assert metrics["backend_open_failures"] >= 1
    assert "could not be opened" in run.log


def test_token_comparison_detects_wrong_kv(runs: BackendRuns, baseline: EngineRun) -> None:
    """Restored garbage (random bytes of the right size) changes the tokens, so the equality
    checks above would catch a connector that restored the wrong bytes."""
    if runs.backend != "memory":
        pytest.skip("done once, on the backend whose objects the test process can reach")
    assert runs.restore.step("scramble")["result"] >= 2 * A_STORED_BLOCKS
    scrambled = runs.restore.step("A_scrambled")
    assert scrambled["num_cached_tokens"] == [A_BLOCKS * BLOCK_SIZE]
    assert scrambled["tokens"] != _tokens(baseline, "A")
