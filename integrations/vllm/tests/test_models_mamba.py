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
4. after a bit of every stored object is flipped, a fresh engine asked for A: every lookup
   finds its blocks, every load fails its check, and vLLM recomputes the request (a hybrid
   model's loads run in the background: vLLM recovers a failed one only that way).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import CACHE, Prompts, run_engine
from kvcore_vllm.session import write_model

BLOCK = 64  # tokens: vLLM sizes the attention page to hold the state page
A_FULL_BLOCKS = (600 - 1) // BLOCK
SHARED_TOKENS = 420  # C shares 70 % of A's 600 tokens
C_FULL_BLOCKS = SHARED_TOKENS // BLOCK


@pytest.fixture(scope="module")
def mamba_model() -> Path:
    return write_model(CACHE / "models" / "mamba", "mamba")


@pytest.fixture(scope="module")
def prompt_c(prompts: Prompts) -> list[int]:
    a = prompts.a
    return a[:SHARED_TOKENS] + [(t % 510) + 1 for t in (x + 3 for x in a[SHARED_TOKENS:])]


def _connector(root: Path) -> dict[str, Any]:
    return {"backend": "file", "backend_config": {"root": str(root)}, "namespace": "mamba"}


def _generate(name: str, prompt: list[int]) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompts": [prompt], "max_tokens": 8, "logprobs": True}


STATS = {"op": "log_stats", "name": "stats"}


def test_a_mamba_hybrid_restores_attention_and_the_state_at_the_boundary(
    mamba_model: Path, prompts: Prompts, prompt_c: list[int], tmp_path: Path
) -> None:
    a, c = prompts.a, prompt_c
    model = {"model": str(mamba_model), "block_size": BLOCK, "max_num_batched_tokens": BLOCK}
    root = tmp_path / "store"

    baseline = run_engine(
        {**model, "connector": None, "steps": [_generate("A", a), _generate("C", c)]},
        tmp_path,
        "mamba-baseline",
    )
    store = run_engine(
        {**model, "connector": _connector(root), "steps": [_generate("A", a), STATS]},
        tmp_path,
        "mamba-store",
    )
    assert "(full), 2 layers" in store.log and "(mamba), 2 layers" in store.log
    assert store.step("A")["num_cached_tokens"] == [0]
    assert store.step("A")["tokens"] == baseline.step("A")["tokens"]

    restore = run_engine(
        {
            **model,
            "connector": _connector(root),
            "steps": [_generate("A", a), STATS, _generate("C", c)],
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
    stored = store.step("stats")["metrics"]
    print(f"storing A: {stored}; restoring A: {restored}")
    assert restored["load_async_requests"] == 1

    # every object corrupt: found by the lookup, refused by the load, recomputed
    flipped = _flip_last_byte_of_every_object(root)
    # k and v objects of A's blocks in both groups, and those C added
    assert flipped >= 2 * 2 * A_FULL_BLOCKS
    failed = run_engine(
        {**model, "connector": _connector(root), "steps": [_generate("A", a), STATS]},
        tmp_path,
        "mamba-failed-restore",
    )
    assert failed.step("A")["tokens"] == baseline.step("A")["tokens"]
    assert failed.step("A")["logprobs"] == baseline.step("A")["logprobs"]
    counted = failed.step("stats")["metrics"]
    assert counted["lookup_hit_blocks"] == A_FULL_BLOCKS
    assert counted["load_failed_requests"] == 1
    assert counted.get("load_done_blocks", 0) == 0


def _flip_last_byte_of_every_object(root: Path) -> int:
    """Flip a payload bit of each kv_file object under ``root`` (its last byte is payload)."""
    files = list(root.rglob("*.kv"))
    for path in files:
        with open(path, "r+b") as f:
            f.seek(-1, 2)
            byte = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([byte[0] ^ 0x10]))
    return len(files)
