"""kill -9 soak of every write policy and stack kind: a writer process is killed at random
moments, again and again; afterwards every block it saw acknowledged must be in some tier,
byte for byte (issue 36). Bounded in time: ``KVCORE_SOAK_KILLS`` kills per stack (8)."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import pytest

import kvcore
from kvcore.keys import KeyScope, block_hashes
from kvcore.testing import Harness, blocks_equal
from kvcore.testing.harness import Sequence_

KILLS = int(os.environ.get("KVCORE_SOAK_KILLS", "8"))

_WRITER = textwrap.dedent(
    """
    import json, sys
    import kvcore
    from kvcore.keys import KeyScope, block_hashes
    from kvcore.testing import Harness
    from kvcore.testing.harness import Sequence_
    config, layout = json.loads(sys.argv[1]), kvcore.CacheLayout(**json.loads(sys.argv[2]))
    first = int(sys.argv[3])
    backend = kvcore.open_backend("tiered", config, context={"layout": layout})
    h = Harness(backend, layout)
    print("ready", flush=True)
    for i in range(first, first + 1_000_000):
        tokens = [i] * layout.block_size
        scope = KeyScope(namespace="soak")
        seq = Sequence_(tokens, block_hashes(tokens, layout.block_size, scope))
        if h.write(seq, timeout_s=2.0) == 1:
            print(i, flush=True)
    """
)


def soak_layout() -> kvcore.CacheLayout:
    """One layer, K and V of 4 KiB each."""
    return kvcore.CacheLayout(
        num_layers=1, num_heads=8, block_size=16, head_dim=16, dtype="float16", num_blocks=64
    )


def block(layout: kvcore.CacheLayout, i: int) -> Sequence_:
    tokens = [i] * layout.block_size
    return Sequence_(tokens, block_hashes(tokens, layout.block_size, KeyScope(namespace="soak")))


def near_file(tmp_path) -> dict[str, Any]:
    # small: most acknowledged blocks leave it while the soak runs
    return {"backend": "file", "root": str(tmp_path / "near"), "capacity_bytes": 262144,
            "rescan_interval_s": 0}  # fmt: skip


def far_file(tmp_path) -> dict[str, Any]:
    return {"backend": "file", "root": str(tmp_path / "far"), "rescan_interval_s": 0}


def soak(config: dict[str, Any], kills: int) -> dict[str, int]:
    """Kill a writer of the stack ``config`` ``kills`` times; then count the acknowledged
    blocks a fresh opening of the stack cannot read, or reads with other bytes."""
    layout = soak_layout()
    rng = random.Random(36)
    acked: list[int] = []
    first = 0
    for _ in range(kills):
        child = subprocess.Popen(
            [sys.executable, "-c", _WRITER, json.dumps(config), layout.model_dump_json(),
             str(first)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready", "the writer did not start"
            until = time.monotonic() + rng.uniform(0.3, 1.2)
            while (left := until - time.monotonic()) > 0:
                if select.select([child.stdout], [], [], left)[0]:
                    line = child.stdout.readline()
                    if line.endswith("\n"):
                        acked.append(int(line))
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            for line in child.stdout:  # acknowledged before the kill, not yet read
                if line.endswith("\n"):
                    acked.append(int(line))
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
        first = (max(acked) + 1) if acked else first + 1_000_000
    stack = kvcore.open_backend("tiered", config, context={"layout": layout})
    h = Harness(stack, layout)
    neither = wrong = 0
    try:
        for i in acked:
            seq = block(layout, i)
            done, got = h.read(seq)
            if done != 1:
                neither += 1
            elif blocks_equal(got, h.payload(seq, 0, 1)):
                wrong += 1
    finally:
        stack.close()
    return {"kills": kills, "acknowledged": len(acked), "in_neither_tier": neither,
            "wrong_bytes": wrong}  # fmt: skip


def report(name: str, counts: dict[str, int]) -> None:
    print(f"soak {name}: {json.dumps(counts)}")
    assert counts["acknowledged"] > counts["kills"], counts
    assert counts["in_neither_tier"] == 0 and counts["wrong_bytes"] == 0, counts


@pytest.mark.parametrize("policy", ["write-through", "write-back-on-evict"])
def test_file_over_file_loses_nothing_acknowledged_under_kill_9(tmp_path, policy) -> None:
    config = {"tiers": [near_file(tmp_path), far_file(tmp_path)], "write_policy": policy}
    report(f"file/file {policy}", soak(config, KILLS))


def test_memory_over_file_loses_nothing_acknowledged_under_kill_9(tmp_path) -> None:
    config = {"tiers": [{"backend": "memory"}, far_file(tmp_path)]}
    report("memory/file write-through", soak(config, KILLS))


@pytest.mark.parametrize("policy", ["write-through", "write-back-on-evict"])
def test_file_over_mooncake_loses_nothing_acknowledged_under_kill_9(
    tmp_path, policy, mooncake_cluster_factory: Callable[..., Any]
) -> None:
    pytest.importorskip("kv_mooncake.testing", reason="kv_mooncake is not installed")
    cluster = mooncake_cluster_factory(storage_bytes=256 << 20)
    mooncake = {"backend": "mooncake", "config": cluster.config(default_timeout_s=2.0)}
    config = {"tiers": [near_file(tmp_path), mooncake], "write_policy": policy}
    report(f"file/mooncake {policy}", soak(config, KILLS))
