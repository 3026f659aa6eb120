"""A sliding-window hybrid (Gemma 3: sliding-window layers between full-attention ones) through
the connector on real CPU engines, with vLLM's hybrid KV cache manager left on.

The tiny random Gemma 3 the test writes has 4 layers, a 64-token window on layers 0 and 2, full
attention on 1 and 3: vLLM keeps two KV cache groups. The connector stores both; a restore
loads every full-attention block and only the sliding-window blocks inside the window of the
restored position.

Engines (each a fresh process; one kv_file store):

1. without the connector (hybrid manager on): the tokens every run must match;
2. storing prompt A;
3. a fresh engine restoring A (every full block) and C (shares 70 % of A: the shared blocks);
4. the same model as full attention (``disable_hybrid_kv_cache_manager``, as vLLM runs it for
   a connector without hybrid support) on the same store: the hybrid blocks are never restored
   into it (0 cached tokens), and it stores A its own way;
5. a fresh full-attention engine restoring A: the bytes a restore reads, against 3's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (
    BLOCK_SIZE,
    CACHE,
    SHARED_TOKENS,
    STATS_STEP,
    Prompts,
    file_connector,
    generate_step,
    run_engine,
)
from kvcore_vllm.session import write_model

A_FULL_BLOCKS = (600 - 1) // BLOCK_SIZE
C_FULL_BLOCKS = SHARED_TOKENS // BLOCK_SIZE
WINDOW = 64  # tokens: the model's sliding window


@pytest.fixture(scope="module")
def swa_model() -> Path:
    return write_model(CACHE / "models" / "swa", "swa")


def test_a_sliding_window_hybrid_restores_its_blocks_with_the_hybrid_manager_on(
    swa_model: Path, prompts: Prompts, prompt_c: list[int], tmp_path: Path
) -> None:
    a, c = prompts.a, prompt_c
    model = {"model": str(swa_model)}
    root = tmp_path / "store"

    baseline = run_engine(
        {**model, "connector": None, "steps": [generate_step("A", a), generate_step("C", c)]},
        tmp_path,
        "swa-baseline",
    )
    store = run_engine(
        {
            **model,
            "connector": file_connector(root, "swa"),
            "steps": [generate_step("A", a), STATS_STEP],
        },
        tmp_path,
        "swa-store",
    )
    # the hybrid manager stayed on: the connector stores both groups
    assert "(full), 2 layers" in store.log and "(sliding_window), 2 layers" in store.log
    assert store.step("A")["num_cached_tokens"] == [0]
    assert store.step("A")["tokens"] == baseline.step("A")["tokens"]

    restore = run_engine(
        {
            **model,
            "connector": file_connector(root, "swa"),
            "steps": [generate_step("A", a), STATS_STEP, generate_step("C", c)],
        },
        tmp_path,
        "swa-restore",
    )
    assert restore.step("A")["num_cached_tokens"] == [A_FULL_BLOCKS * BLOCK_SIZE]
    assert restore.step("A")["tokens"] == baseline.step("A")["tokens"]
    assert restore.step("C")["num_cached_tokens"] == [C_FULL_BLOCKS * BLOCK_SIZE]
    assert restore.step("C")["tokens"] == baseline.step("C")["tokens"]

    # the same model run as full attention, on the same store
    full = {**model, "disable_hybrid_kv_cache_manager": True}
    full_store = run_engine(
        {
            **full,
            "connector": file_connector(root, "swa"),
            "steps": [generate_step("A", a), STATS_STEP],
        },
        tmp_path,
        "full-store",
    )
    assert full_store.step("A")["num_cached_tokens"] == [0], "a hybrid block restored as full"
    full_restore = run_engine(
        {
            **full,
            "connector": file_connector(root, "swa"),
            "steps": [generate_step("A", a), STATS_STEP],
        },
        tmp_path,
        "full-restore",
    )
    assert full_restore.step("A")["num_cached_tokens"] == [A_FULL_BLOCKS * BLOCK_SIZE]

    # what the engine reports about the restore stays vLLM's count of blocks; the window's
    # blocks are counted apart
    restored = restore.step("stats")["metrics"]
    assert restored["lookup_hit_blocks"] == restored["load_done_blocks"] == A_FULL_BLOCKS
    assert restored["sliding_window_load_done_blocks"] == 2  # tokens 513..576: blocks 16, 17
    assert restored["sliding_window_lookup_hit_blocks"] == 2
    hybrid_read = restored["load_bytes"]
    full_read = full_restore.step("stats")["metrics"]["load_bytes"]
    hybrid_stored = store.step("stats")["metrics"]["save_bytes"]
    full_stored = full_store.step("stats")["metrics"]["save_bytes"]
    print(
        f"restore of A ({A_FULL_BLOCKS} blocks): hybrid reads {hybrid_read} bytes, full "
        f"attention {full_read}; storing A: hybrid {hybrid_stored}, full attention {full_stored}"
    )
    # the full-attention layers' blocks, and the sliding-window layers' inside the window
    per_layer_block = 2 * 2 * BLOCK_SIZE * 32 * 2  # K and V, 2 KV heads, 32 dims, bfloat16
    window_blocks = -(-(WINDOW - 1) // BLOCK_SIZE) + 1  # blocks of the next token's window
    assert full_read == A_FULL_BLOCKS * 4 * per_layer_block
    assert hybrid_read <= (A_FULL_BLOCKS * 2 + window_blocks * 2) * per_layer_block
    assert hybrid_read < full_read
