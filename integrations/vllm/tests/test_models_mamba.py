"""A Mamba hybrid (Qwen3-Next: gated-delta-net layers between full-attention ones) through the
connector on real CPU engines, with vLLM's hybrid KV cache manager and prefix caching on.

With prefix caching on, vLLM keeps the recurrent state reached at a block boundary in that
block of the Mamba group (``mamba_cache_mode`` ``align``). The connector stores those state
blocks next to the attention blocks; a restore ends at a boundary whose state is stored and
loads every attention block before it plus the one state block, never attention without the
state. Prefill runs in 64-token steps (one block), so vLLM reaches a state at every boundary
(by default it keeps one at the prompt's last boundary only) and a prompt sharing 70 % finds
one inside the shared part.

Engines (each a fresh process; one kv_file store):

1. without the connector: the tokens every run must match;
2. storing prompt A;
3. a fresh engine restoring A (every full block) and C (shares 70 % of A: the shared blocks);
   Then a bit of every stored object is flipped and A asked again: every lookup finds its
   blocks, every load fails its check, and vLLM recomputes the request (a hybrid model's loads
   run in the background: vLLM recovers a failed one only that way).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (
    CACHE,
    SHARED_TOKENS,
    STATS_STEP,
    Prompts,
    file_connector,
    generate_step,
    run_engine,
)
from kvcore_vllm.session import write_model

BLOCK = 64  # tokens: vLLM sizes the attention page to hold the state page
A_FULL_BLOCKS = (600 - 1) // BLOCK
C_FULL_BLOCKS = SHARED_TOKENS // BLOCK


@pytest.fixture(scope="module")
def mamba_model() -> Path:
    return write_model(CACHE / "models" / "mamba", "mamba")


def test_a_mamba_hybrid_restores_attention_and_the_state_at_the_boundary(
    mamba_model: Path, prompts: Prompts, prompt_c: list[int], tmp_path: Path
) -> None:
    a, c = prompts.a, prompt_c
    # every engine on one core: vLLM gives an engine with a connector one more OpenMP thread
    # (it reserves a core for the connector, which a 2-core machine cannot spare), and where
    # its GDN kernels are the accelerated ones (AVX-512 BF16 or AMX) the thread count changes
    # the floats: the engine storing A, restoring nothing, already differed from the baseline
    model = {
        "model": str(mamba_model),
        "block_size": BLOCK,
        "max_num_batched_tokens": BLOCK,
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"},
    }
    root = tmp_path / "store"

    baseline = run_engine(
        {
            **model,
            "connector": None,
            "steps": [generate_step("A", a, logprobs=True), generate_step("C", c, logprobs=True)],
        },
        tmp_path,
        "mamba-baseline",
    )
    store = run_engine(
        {
            **model,
            "connector": file_connector(root, "mamba"),
            "steps": [generate_step("A", a, logprobs=True), STATS_STEP],
        },
        tmp_path,
        "mamba-store",
    )
    assert "(full), 2 layers" in store.log and "(mamba), 2 layers" in store.log
    assert store.step("A")["num_cached_tokens"] == [0]
    assert store.step("A")["tokens"] == baseline.step("A")["tokens"]

    corrupt = {
        "op": "call",
        "name": "corrupt",
        "target": "engine_helpers:flip_last_byte_of_every_object",
        "args": {"root": str(root)},
    }
    restore = run_engine(
        {
            **model,
            "connector": file_connector(root, "mamba"),
            "steps": [
                generate_step("A", a, logprobs=True),
                STATS_STEP,
                generate_step("C", c, logprobs=True),
                # every object corrupt: found by the lookup, refused by the load, recomputed
                corrupt,
                {"op": "reset_prefix_cache"},
                {**STATS_STEP, "name": "before"},
                generate_step("A_failed", a, logprobs=True),
                {**STATS_STEP, "name": "failed_stats"},
            ],
        },
        tmp_path,
        "mamba-restore",
    )
    for name, blocks in (("A", A_FULL_BLOCKS), ("C", C_FULL_BLOCKS)):
        assert restore.step(name)["num_cached_tokens"] == [blocks * BLOCK]
        assert restore.step(name)["tokens"] == baseline.step(name)["tokens"]
        # the tiny model's greedy tokens barely depend on its recurrent state (a restore
        # without the state still picks them): the logprobs are the same floats only when
        # the state and the attention blocks are the bytes the baseline computed
        assert restore.step(name)["logprobs"] == baseline.step(name)["logprobs"]

    # vLLM's count of restored blocks is the attention group's; one state block per restore
    restored = restore.step("stats")["metrics"]
    assert restored["lookup_hit_blocks"] == restored["load_done_blocks"] == A_FULL_BLOCKS
    assert restored["mamba_load_done_blocks"] == 1
    assert restored["load_async_requests"] == 1
    stored = store.step("stats")["metrics"]
    print(f"storing A: {stored}; restoring A: {restored}")

    # k and v objects of A's blocks in both groups, and those C added
    assert restore.step("corrupt")["result"] >= 2 * 2 * A_FULL_BLOCKS
    failed = restore.step("A_failed")
    assert failed["tokens"] == baseline.step("A")["tokens"]
    assert failed["logprobs"] == baseline.step("A")["logprobs"]
    counted = restore.step("failed_stats")["metrics"]
    assert counted["lookup_hit_blocks"] == A_FULL_BLOCKS
    assert counted["load_failed_requests"] == 1
    assert counted.get("load_done_blocks", 0) == 0
