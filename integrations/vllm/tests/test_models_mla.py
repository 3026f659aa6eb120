"""MLA (DeepSeek-V3's latent cache) through the connector on real CPU engines.

A tiny random DeepSeek-V3 (two dense MLA layers, written by the test) runs on vLLM's reference
CPU MLA backend, asked for by name: on a processor with AMX tiles vLLM would pick AMX_MLA,
which wants blocks of a multiple of 32 and failed the 16-token engines here. CPU_MLA forces
16-token blocks and turns vLLM's own prefix cache off, so every hit
below is the connector's. The latent is the same on every TP rank: one TP rank of each
pipeline stage stores it, every rank reads it, and the objects are named for no TP degree
(``r0of1``), so a block written at TP=2 restores at TP=1 and the reverse.

Engines (each a fresh process; kv_file stores in ``tp1/`` and ``tp2/``):

1. TP=1 without the connector: the tokens every TP=1 run must match;
2. TP=1 storing prompt A into ``tp1/``;
3. a fresh TP=1 restoring A (every full block) and C (shares 70 % of A: the shared blocks);
4. TP=2 storing A into ``tp2/`` (bytes counted by the backend: equal to TP=1's);
5. a fresh TP=1 restoring A from ``tp2/``;
6. a fresh TP=2 restoring A from ``tp1/``, tokens equal to TP=2's own computed answer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (
    CACHE,
    SHARED_TOKENS,
    Prompts,
    file_connector,
    file_store_contents,
    generate_step,
    run_engine,
)
from kvcore_vllm.session import write_model

NAMESPACE = "mla"
MLA_BLOCK = 16  # vLLM's CPU MLA backend overrides any other block size
A_FULL_BLOCKS = (600 - 1) // MLA_BLOCK  # the last prompt token is always computed
C_FULL_BLOCKS = SHARED_TOKENS // MLA_BLOCK
TP2 = {
    "executor": "mp",
    "tensor_parallel_size": 2,
    # one core per worker (vLLM's automatic binding wants a NUMA node per worker)
    "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
}


@pytest.fixture(scope="module")
def mla_model() -> Path:
    return write_model(CACHE / "models" / "mla", "mla")


def test_mla_blocks_are_stored_once_and_restored_across_tp_sizes(
    mla_model: Path, prompts: Prompts, prompt_c: list[int], tmp_path: Path
) -> None:
    a, c = prompts.a, prompt_c
    model = {"model": str(mla_model), "block_size": MLA_BLOCK, "attention_backend": "CPU_MLA"}
    tp1, tp2 = tmp_path / "tp1", tmp_path / "tp2"

    baseline = run_engine(
        {**model, "connector": None, "steps": [generate_step("A", a), generate_step("C", c)]},
        tmp_path,
        "mla-baseline",
    )
    store1 = run_engine(
        {**model, "connector": file_connector(tp1, NAMESPACE), "steps": [generate_step("A", a)]},
        tmp_path,
        "mla-tp1-store",
    )
    assert store1.step("A")["num_cached_tokens"] == [0]
    assert store1.step("A")["tokens"] == baseline.step("A")["tokens"]
    at_tp1 = file_store_contents(tp1, NAMESPACE)
    assert at_tp1["objects"] > 0

    restore1 = run_engine(
        {
            **model,
            "connector": file_connector(tp1, NAMESPACE),
            "steps": [
                generate_step("A", a),
                generate_step("C", c),
                {"op": "log_stats", "name": "stats"},
            ],
        },
        tmp_path,
        "mla-tp1-restore",
    )
    assert restore1.step("A")["num_cached_tokens"] == [A_FULL_BLOCKS * MLA_BLOCK]
    assert restore1.step("A")["tokens"] == baseline.step("A")["tokens"]
    assert restore1.step("C")["num_cached_tokens"] == [C_FULL_BLOCKS * MLA_BLOCK]
    assert restore1.step("C")["tokens"] == baseline.step("C")["tokens"]

    names = {
        "op": "call",
        "name": "names",
        "target": "engine_helpers:blocks_by_rank_name",
        "args": {"prompt": a},
    }
    store2 = run_engine(
        {
            **model,
            **TP2,
            "connector": file_connector(tp2, NAMESPACE),
            "steps": [
                generate_step("A", a),
                {"op": "sleep", "seconds": 2.0},  # the writer rank's saves land
                names,
            ],
        },
        tmp_path,
        "mla-tp2-store",
    )
    assert store2.step("A")["num_cached_tokens"] == [0]
    # stored once per block, not once per rank: the same objects and bytes as TP=1's
    at_tp2 = file_store_contents(tp2, NAMESPACE)
    assert at_tp2 == at_tp1, (at_tp1, at_tp2)
    # named for no TP degree: what TP=1 reads, not one object per rank
    assert store2.step("names")["result"] == {"r0of1": A_FULL_BLOCKS, "r0of2": 0, "r1of2": 0}

    from_tp2 = run_engine(
        {**model, "connector": file_connector(tp2, NAMESPACE), "steps": [generate_step("A", a)]},
        tmp_path,
        "mla-tp1-restores-tp2",
    )
    assert from_tp2.step("A")["num_cached_tokens"] == [A_FULL_BLOCKS * MLA_BLOCK]
    assert from_tp2.step("A")["tokens"] == baseline.step("A")["tokens"]

    from_tp1 = run_engine(
        {
            **model,
            **TP2,
            "connector": file_connector(tp1, NAMESPACE),
            "steps": [generate_step("A", a)],
        },
        tmp_path,
        "mla-tp2-restores-tp1",
    )
    assert from_tp1.step("A")["num_cached_tokens"] == [A_FULL_BLOCKS * MLA_BLOCK]
    # the reading engine's own answer: TP=2 computed A above with nothing to restore
    assert from_tp1.step("A")["tokens"] == store2.step("A")["tokens"]
