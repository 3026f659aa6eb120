"""Background loads (``load_mode: async``) on the real vLLM engine, over kv_file.

One in-process engine with a dense model: it stores prompt A, then restores it with the
request waiting outside the batch for its blocks (vLLM's ``WAITING_FOR_REMOTE_KVS``), and its
tokens are compared with an engine that has no connector. The restore costs one lookup and one
read per block: the read asks no second query. A load that fails part-way through the run (a
corrupt object found in the middle of it) keeps the blocks before the failure and recomputes
the rest: the same tokens again. A
request aborted while its read is still running leaves nothing behind: the next restore is
exact, and the engine's shutdown leaves no kvcore thread and no open store file.
"""

from __future__ import annotations

from pathlib import Path

from conftest import BLOCK_SIZE, EngineRun, Prompts, run_engine

#: A's blocks a restore loads: (600 - 1) // 32 (vLLM computes the last token)
A_BLOCKS = (600 - 1) // BLOCK_SIZE


def test_background_loads_restore_exactly_and_fail_or_abort_cleanly(
    model_dir: Path, prompts: Prompts, baseline: EngineRun, tmp_path: Path
) -> None:
    root = str(tmp_path / "store")
    connector = {
        "backend": "file",
        "backend_config": {"root": root},
        "namespace": "async",
        "load_mode": "async",
    }
    a = {"op": "generate", "prompts": [prompts.a], "max_tokens": prompts.a_new_tokens}
    reset = {"op": "reset_prefix_cache"}
    run = run_engine(
        {
            "model": str(model_dir),
            "connector": connector,
            "in_process": True,
            "steps": [
                {**a, "name": "A_store"},
                reset,
                {"op": "log_stats", "name": "before"},
                # one token: the restore moves A's blocks and saves nothing
                {**a, "name": "A_one", "max_tokens": 1},
                {"op": "log_stats", "name": "one_stats"},
                reset,
                {**a, "name": "A_restored"},
                reset,
                {
                    "op": "call",
                    "target": "engine_helpers:flip_bit_in_file_store",
                    "args": {"root": root, "prompt": prompts.a, "block": 9},
                },
                {"op": "log_stats", "name": "before_corrupt"},
                {**a, "name": "A_corrupt"},
                {"op": "log_stats", "name": "corrupt_stats"},
                reset,
                {
                    "op": "call",
                    "name": "abort",
                    "target": "engine_helpers:abort_while_loading",
                    "args": {"prompt": prompts.a, "store_root": root},
                },
                reset,
                {**a, "name": "A_after_abort"},
                {"op": "shutdown", "store_root": root},
            ],
        },
        tmp_path,
        "async-loads",
    )
    want = baseline.step("A")["tokens"]
    assert run.step("A_store")["tokens"] == want

    # a background restore: every block, in one lookup and one read each
    one = run.step("A_one")
    assert one["num_cached_tokens"] == [A_BLOCKS * BLOCK_SIZE]
    assert one["tokens"] == [want[0][:1]]
    stats = run.step("one_stats")["metrics"]
    assert stats["load_async_requests"] == 1
    assert stats["load_done_blocks"] == A_BLOCKS
    assert stats["lookup_blocks"] == A_BLOCKS
    # the backend's own counts (scheduler and worker share the one opened backend here):
    # blocks asked by queries and by reads, one each per restored block
    assert stats["kvcore.be.blocks.query"] == A_BLOCKS
    assert stats["kvcore.be.blocks.read"] == A_BLOCKS
    restored = run.step("A_restored")
    assert restored["num_cached_tokens"] == [A_BLOCKS * BLOCK_SIZE]
    assert restored["tokens"] == want

    # block 9 is corrupt: the load reads 0-8 and fails at 9 (kv_file drops the object); the
    # failed blocks are reported by id, so vLLM keeps 0-8 and recomputes from block 9 in the
    # same request: one load, not a second lookup and load of blocks 0-8
    # (vLLM's own num_cached_tokens stays at the 576 tokens matched when the request was
    # admitted: its prefill stats are not corrected after a failed background load)
    corrupt = run.step("A_corrupt")
    assert corrupt["tokens"] == want
    failed = run.step("corrupt_stats")["metrics"]
    assert failed["load_failed_requests"] == 1
    assert failed["load_async_requests"] == 1
    assert failed["load_done_blocks"] == 9
    assert failed["load_failed_blocks"] == A_BLOCKS - 9

    # block 9 was saved again after its recomputation: A_after_abort restores all 18 blocks
    # aborted with its read still running: nothing is left behind
    abort = run.step("abort")["result"]
    assert abort["reads_running_at_abort"] >= 1, abort
    after = run.step("A_after_abort")
    assert after["num_cached_tokens"] == [A_BLOCKS * BLOCK_SIZE]
    assert after["tokens"] == want
    closed = run.step("shutdown")
    assert closed["kvcore_threads"] == []
    assert closed["store_files_open"] == []
