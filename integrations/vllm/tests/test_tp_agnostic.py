"""Blocks shared across TP degrees: ``object_layout: per_head`` on real CPU engines.

The tiny Llama has 2 KV heads: at TP=1 one rank holds both, at TP=2 each rank one. With the
per-head layout every block is stored as one object set per KV head, named ``r<head>of2``
whatever the TP degree, so:

1. TP=1 without the connector: the tokens every TP=1 run must match;
2. TP=1 stores prompt A into ``tp1/``;
3. TP=2 computes A (its own answer) and stores it into ``tp2/``: the same objects and bytes;
4. a fresh TP=2 restores A from ``tp1/`` (every full block), tokens equal to those of TP=2
   without the connector (5);
6. a fresh TP=1 restores A from ``tp2/``, tokens equal to the TP=1 baseline.
"""

from __future__ import annotations

from pathlib import Path

from conftest import (
    BLOCK_SIZE,
    Prompts,
    file_connector,
    file_store_contents,
    generate_step,
    run_engine,
)

NAMESPACE = "tp-agnostic"
A_FULL_BLOCKS = (600 - 1) // BLOCK_SIZE
TP2 = {
    "executor": "mp",
    "tensor_parallel_size": 2,
    # one core per worker (vLLM's automatic binding wants a NUMA node per worker)
    "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
}


def test_a_block_written_at_one_tp_degree_restores_at_another(
    model_dir: Path, prompts: Prompts, tmp_path: Path
) -> None:
    a = prompts.a
    model = {"model": str(model_dir)}
    tp1, tp2 = tmp_path / "tp1", tmp_path / "tp2"
    names = {
        "op": "call",
        "name": "names",
        "target": "engine_helpers:blocks_by_rank_name",
        "args": {"prompt": a},
    }
    settle = {"op": "sleep", "seconds": 2.0}  # the workers' saves land

    baseline = run_engine(
        {**model, "connector": None, "steps": [generate_step("A", a)]}, tmp_path, "tp1-baseline"
    )
    store1 = run_engine(
        {
            **model,
            "connector": file_connector(tp1, NAMESPACE, object_layout="per_head"),
            "steps": [generate_step("A", a), settle, names],
        },
        tmp_path,
        "tp1-store",
    )
    assert store1.step("A")["num_cached_tokens"] == [0]
    assert store1.step("A")["tokens"] == baseline.step("A")["tokens"]
    # one object set per KV head (r<head>of2), written by the one rank that holds both
    assert store1.step("names")["result"] == {
        "r0of1": 0,
        "r0of2": A_FULL_BLOCKS,
        "r1of2": A_FULL_BLOCKS,
    }

    store2 = run_engine(
        {
            **model,
            **TP2,
            "connector": file_connector(tp2, NAMESPACE, object_layout="per_head"),
            "steps": [generate_step("A", a), settle, names],
        },
        tmp_path,
        "tp2-store",
    )
    assert store2.step("A")["num_cached_tokens"] == [0]
    assert store2.step("names")["result"] == store1.step("names")["result"]
    at_tp1, at_tp2 = file_store_contents(tp1, NAMESPACE), file_store_contents(tp2, NAMESPACE)
    assert at_tp1["objects"] == 2 * 2 * A_FULL_BLOCKS  # parts x KV heads per block
    assert at_tp2 == at_tp1, (at_tp1, at_tp2)

    tp2_reads_tp1 = run_engine(
        {
            **model,
            **TP2,
            "connector": file_connector(tp1, NAMESPACE, object_layout="per_head"),
            "steps": [generate_step("A", a)],
        },
        tmp_path,
        "tp2-restores-tp1",
    )
    assert tp2_reads_tp1.step("A")["num_cached_tokens"] == [A_FULL_BLOCKS * BLOCK_SIZE]
    # the reading engine's own no-connector baseline (TP=2 may round differently from TP=1)
    tp2_baseline = run_engine(
        {**model, **TP2, "connector": None, "steps": [generate_step("A", a)]},
        tmp_path,
        "tp2-baseline",
    )
    assert tp2_reads_tp1.step("A")["tokens"] == tp2_baseline.step("A")["tokens"]
    assert store2.step("A")["tokens"] == tp2_baseline.step("A")["tokens"]

    tp1_reads_tp2 = run_engine(
        {
            **model,
            "connector": file_connector(tp2, NAMESPACE, object_layout="per_head"),
            "steps": [generate_step("A", a)],
        },
        tmp_path,
        "tp1-restores-tp2",
    )
    assert tp1_reads_tp2.step("A")["num_cached_tokens"] == [A_FULL_BLOCKS * BLOCK_SIZE]
    assert tp1_reads_tp2.step("A")["tokens"] == baseline.step("A")["tokens"]
