"""The TransferManager driving the AttentionStore backend (on the reference SDK) with Paddle
CPU tensors: device I/O by pointer and block id, suffix-only write-back, and the flush-only
index updates after a read and on host-cache eviction."""

from __future__ import annotations

import numpy as np
import paddle
from attentionstore_sdk import reference_control as control

import kvcore
from kvcore.transfer import DeviceCache, TransferManager

LAYOUT = kvcore.CacheLayout(
    num_layers=3,
    num_extra_layers=1,
    num_heads=2,
    block_size=4,
    head_dim=16,
    num_blocks=32,
    extra_num_blocks=24,
)
FAST = {"readiness_timeout_s": 2.0, "readiness_poll_s": 0.01}


def _cache(fill: bool) -> DeviceCache:
    rng = np.random.default_rng(7)
    tensors = {}
    for part in ("k", "v"):
        tensors[part] = []
        for layer in range(LAYOUT.total_layers):
            t = paddle.zeros(
                [LAYOUT.layer_num_blocks(layer), *LAYOUT.kv_block_shape], dtype="bfloat16"
            )
            if fill:
                view = np.from_dlpack(t.view(paddle.uint8))
                view[...] = rng.integers(0, 256, view.shape, dtype=np.uint8)
            tensors[part].append(t)
    return DeviceCache(LAYOUT, tensors["k"], tensors["v"])


def _block(cache: DeviceCache, block_id: int) -> list[bytes]:
    return [
        np.from_dlpack(t.view(paddle.uint8))[block_id].tobytes()
        for part in ("k", "v")
        for t in cache.tensors[part]
    ]


def test_manager_round_trip_suffix_write_and_flushes():
    src = _cache(fill=True)
    tm = TransferManager(
        {"layout": LAYOUT, "max_model_len": 64}, src, "attentionstore", backend_config=FAST
    )
    tokens = list(range(100, 100 + 6 * LAYOUT.block_size))
    keys = kvcore.block_hashes(tokens, LAYOUT.block_size)
    ids = [3, 4, 5, 6, 7, 8]
    first = tm.write_back(
        {"task_id": "w1", "keys": keys[:2], "device_block_ids": ids[:2], "token_ids": tokens}
    ).result()
    assert (first.num_blocks, first.skipped_blocks) == (2, 0)
    whole = tm.write_back(
        {"task_id": "w2", "keys": keys, "device_block_ids": ids, "token_ids": tokens}
    ).result()
    assert (whole.skipped_blocks, whole.num_blocks, whole.block_ids) == (2, 4, ids[2:])
    writes = control.calls("write")
    assert writes[-1].start_block_idx == 2  # only the unmatched suffix went to the SDK

    dst = _cache(fill=False)
    tm.restore_caches(dst)
    out = [20, 21, 22, 23]
    r = tm.read(
        {
            "task_id": "r",
            "keys": keys[2:],
            "device_block_ids": out,
            "token_ids": tokens,
            "start_block": 2,
        }
    ).result()
    assert (r.num_blocks, r.block_ids) == (4, out)
    for s, d in zip(ids[2:], out, strict=True):
        assert _block(src, s) == _block(dst, d)
    flush = control.calls("flush_token_index")[-1]
    assert (flush.start_block_idx, flush.reside_in_gpu) == (2, True)
    assert flush.token_ids == tuple(tokens)

    # the engine evicts the host-cache node holding block 4 (depth 5): path through it
    ev = tm.evicted_from_host("evict", tokens[: 5 * LAYOUT.block_size], start_block=4).result()
    assert ev.num_blocks == 1
    flush = control.calls("flush_token_index")[-1]
    assert (flush.start_block_idx, flush.reside_in_gpu) == (4, False)
    assert flush.token_ids == tuple(tokens[: 5 * LAYOUT.block_size])
    tm.close()


def test_kvcore_demo_on_attentionstore_verifies_every_byte():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    sdk = Path(__file__).parent / "reference_sdk"
    env = {**os.environ, "PYTHONPATH": str(sdk)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcore",
            "demo",
            "--backend",
            "attentionstore",
            "--config",
            json.dumps(FAST),
            "--conversations",
            "2",
            "--turns",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    s = json.loads(out.stdout)
    assert s["mismatches"] == 0 and s["errors"] == 0
    assert s["blocks_read"] > 0 and s["blocks_written"] > 0
