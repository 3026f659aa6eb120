"""Two tensor-parallel ranks: each stores its own slice, and a block is restored only when
every rank has it (the scheduler asks the backend for each rank and takes the shortest run).

One TP=2 engine (two CPU workers, one core each) on a real Mooncake master stores prompt A,
then rank 1's objects from block 10 on are removed from the cluster (kvcore's
``Backend.remove``); with vLLM's prefix cache
dropped, A is restored for blocks 0-9 only and the tokens match the first, fully computed,
answer. The scheduler asks both ranks through one Mooncake client that mounts no memory (the
master's own count says so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import BLOCK_SIZE, Prompts, favour_mooncake, run_engine

A_BLOCKS = (600 - 1) // BLOCK_SIZE
#: the memory each worker's Mooncake client contributes to the store
WORKER_SEGMENT = 16 << 20


def test_a_block_counts_only_when_every_rank_has_it(
    model_dir: Path, prompts: Prompts, tmp_path: Path, mooncake_cluster_factory: Any
) -> None:
    cluster = mooncake_cluster_factory(storage_bytes=128 << 20)
    # every data client mounts a segment: the master's count then tells who opened one
    backend_config = {**favour_mooncake(cluster), "global_segment_size": WORKER_SEGMENT}
    generate_a = {"op": "generate", "prompts": [prompts.a], "max_tokens": 8}
    run = run_engine(
        {
            "model": str(model_dir),
            "connector": {
                "backend": "mooncake",
                "backend_config": backend_config,
                "namespace": "tp",
            },
            "executor": "mp",
            "tensor_parallel_size": 2,
            # one core per worker (vLLM's automatic binding wants a NUMA node per worker)
            "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
            "steps": [
                {**generate_a, "name": "computed"},
                {
                    "op": "call",
                    "name": "mounted",
                    "target": "engine_helpers:mooncake_mounted_bytes",
                    "args": {"metrics_port": cluster.master.metrics_port},
                },
                {"op": "reset_prefix_cache"},
                {**generate_a, "name": "both_ranks"},
                {"op": "reset_prefix_cache"},
                {
                    "op": "call",
                    "name": "remove",
                    "target": "engine_helpers:remove_rank_objects",
                    "args": {"prompt": prompts.a, "rank": 1, "from_block": 10},
                },
                {"op": "reset_prefix_cache"},
                {**generate_a, "name": "rank1_partial"},
                {"op": "log_stats", "name": "stats"},
            ],
        },
        tmp_path,
        "tp2",
    )
    computed = run.step("computed")
    assert computed["num_cached_tokens"] == [0]
    # the storage node and the two workers' segments: the scheduler's one lookup client (for
    # both ranks) mounts nothing
    assert run.step("mounted")["result"] == cluster.storage_bytes + 2 * WORKER_SEGMENT
    both = run.step("both_ranks")
    assert both["num_cached_tokens"] == [A_BLOCKS * BLOCK_SIZE]
    assert both["tokens"] == computed["tokens"]
    removal = run.step("remove")["result"]
    assert removal == {"removed": A_BLOCKS - 10, "failure": None}  # blocks 10..17
    partial = run.step("rank1_partial")
    assert partial["num_cached_tokens"] == [10 * BLOCK_SIZE]
    assert partial["tokens"] == computed["tokens"]
    # both workers loaded exactly the agreed run: 2 ranks x (18 + 10) blocks
    assert run.step("stats")["metrics"]["load_done_blocks"] == 2 * (A_BLOCKS + 10)
