"""A local file tier in front of a real Mooncake cluster (master and storage node on
127.0.0.1): the master dies while the stack serves reads, and comes back."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import kvcore
from kvcore.testing import Harness, blocks_equal, small_layout

mooncake_testing = pytest.importorskip("kv_mooncake.testing", reason="kv_mooncake is not installed")


def test_reads_keep_hitting_the_file_tier_while_the_master_is_dead_then_writes_reach_it_again(
    tmp_path, mooncake_cluster_factory: Callable[..., mooncake_testing.MooncakeCluster]
) -> None:
    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    layout = small_layout()
    mooncake = cluster.config(default_timeout_s=2.0)
    stack = kvcore.open_backend(
        "tiered",
        {
            "tiers": [
                {"backend": "file", "root": str(tmp_path / "near"), "rescan_interval_s": 0},
                {"backend": "mooncake", "config": mooncake},
            ],
            "lower_timeout_s": 2.0,
        },
        context={"layout": layout},
    )  # not strict: an engine's stack, where a tier's failure must never raise
    direct = kvcore.open_backend("mooncake", mooncake, context={"layout": layout})
    h, far = Harness(stack, layout), Harness(direct, layout)
    try:
        stored = [h.new_sequence(4) for _ in range(5)]
        for seq in stored:
            assert h.write(seq) == 4
        assert stack.plugin.flush(30)
        assert all(far.query(seq) == 4 for seq in stored), "write-through did not reach Mooncake"

        cluster.master.kill()
        wrong = 0
        until = time.monotonic() + 5
        rounds = 0
        while time.monotonic() < until:  # a few seconds of traffic with the master dead
            for seq in stored:
                assert h.query(seq, timeout_s=2.0) == 4
                done, got = h.read(seq, timeout_s=2.0)
                assert done == 4
                wrong += len(blocks_equal(got, h.payload(seq, 0, 4)))
            rounds += 1
        assert wrong == 0 and rounds >= 2
        # writes are acknowledged by the file tier; their copies to Mooncake fail, counted
        during = h.new_sequence(2)
        assert h.write(during, timeout_s=2.0) == 2
        stats = stack.stats()
        assert stats.get("errors.read", 0) == 0 and stats.get("errors.query", 0) == 0
        assert stats["backend_tier0_read_blocks"] >= 4 * 5 * rounds
        assert stats.get("backend_tier1_read_blocks", 0) == 0

        cluster.master.start()  # the same ports; Mooncake's clients reconnect by themselves
        after = h.new_sequence(3)
        deadline = time.monotonic() + 30
        while True:
            assert h.write(after, timeout_s=2.0) == 3
            stack.plugin.flush(10)
            if far.query(after, timeout_s=2.0) == 3:
                break
            assert time.monotonic() < deadline, "no write reached Mooncake 30 s after restart"
            time.sleep(0.5)
        done, got = far.read(after)
        assert done == 3 and blocks_equal(got, h.payload(after, 0, 3)) == []
    finally:
        cluster.master.resume()
        stack.close()
        direct.close()


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_writes_that_evict_return_by_their_deadline_with_the_master_down(
    tmp_path, mooncake_cluster_factory: Callable[..., mooncake_testing.MooncakeCluster], fault
) -> None:
    """Issue 36 #3: file (128 KiB) over Mooncake, write-back-on-evict, every write with a 1 s
    deadline: with the master SIGKILLed writes took up to 13.3 s, SIGSTOPped up to 9 s, and
    evicted objects were lost. Now: every write returns by its deadline, and every block
    acknowledged while the master was down is in one tier or the other once it is back (with
    SIGSTOP, every block acknowledged at all).

    By its deadline plus what the same call costs on this machine now, timed in the same run
    with the master up: the writes that filled the near tier (the last evicting into Mooncake)
    bound what a call does besides waiting. On a busy CI machine a write that waited its 1 s
    took 1.06-1.11 s (a fixed 0.1 s slack failed there); one that waited for Mooncake's RPC
    timeouts would take 9-13 s."""
    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    layout = small_layout()
    stack = kvcore.open_backend(
        "tiered",
        {
            "tiers": [
                {"backend": "file", "root": str(tmp_path / "near"), "rescan_interval_s": 0,
                 "capacity_bytes": 131072},
                {"backend": "mooncake", "config": cluster.config(default_timeout_s=2.0)},
            ],
            "write_policy": "write-back-on-evict",
        },
        context={"layout": layout},
    )  # fmt: skip
    h = Harness(stack, layout)
    timeout = 1.0
    acked, latencies = [], []
    healthy_writes = []  # the same writes with the master up: what a write costs here now
    try:
        while not stack.stats().get("backend_evicted_written_objects"):
            assert len(acked) < 500, "the near tier never evicted into Mooncake"
            seq = h.new_sequence(1)  # filling the near tier until it evicts into Mooncake
            t0 = time.monotonic()
            # (the Harness's 10 s, not the 1 s under test: beside other work at normal
            # priority, a put, made at the lowest, took more than 1 s with the master up)
            assert h.write(seq) == 1
            healthy_writes.append(time.monotonic() - t0)
            acked.append(seq)
        before_fault = len(acked)
        getattr(cluster.master, fault)()
        until = time.monotonic() + 8
        moved = acked[0]  # evicted first: in Mooncake only
        read_latencies, wrong = [], 0
        while time.monotonic() < until:
            seq = h.new_sequence(1)
            t0 = time.monotonic()
            if h.write(seq, timeout_s=timeout) == 1:
                acked.append(seq)
            latencies.append(time.monotonic() - t0)
            t0 = time.monotonic()
            done, got = h.read(moved, timeout_s=timeout)
            read_latencies.append(time.monotonic() - t0)
            wrong += done == 1 and bool(blocks_equal(got, h.payload(moved, 0, 1)))
        assert wrong == 0
        own = max(healthy_writes)
        print(
            f"deadline {fault}: {len(latencies)} writes, p50 {sorted(latencies)[len(latencies) // 2]:.3f}"
            f" s, p100 {max(latencies):.3f} s; reads from Mooncake p100 {max(read_latencies):.3f}"
            f" s; deadline {timeout} s; a write with the master up: {own:.3f} s at most"
        )
        assert max(read_latencies) <= timeout + 0.1 + own, (
            f"{fault}: slowest of {len(read_latencies)} reads took {max(read_latencies):.2f} s"
            f" (a write with the master up: {own:.3f} s)"
        )
        assert max(latencies) <= timeout + 0.1 + own, (
            f"{fault}: slowest of {len(latencies)} writes took {max(latencies):.2f} s"
            f" (a write with the master up: {own:.3f} s)"
        )
        if fault == "kill":
            # a restarted master knows no key of before (Mooncake keeps its metadata in the
            # master's memory): what had moved there is gone with it. What the stack
            # acknowledged while the master was dead never left the near tier.
            acked = acked[before_fault:]
            cluster.master.start()
        else:
            cluster.master.resume()
        lost: list[int] = []
        until = time.monotonic() + 30
        while True:  # Mooncake's clients reconnect by themselves
            lost = [i for i, seq in enumerate(acked) if h.query(seq, timeout_s=2.0) != 1]
            if not lost or time.monotonic() > until:
                break
            time.sleep(0.5)
        assert not lost, f"{fault}: {len(lost)} of {len(acked)} acknowledged blocks in no tier"
        for seq in acked:
            done, got = h.read(seq, timeout_s=2.0)
            assert done == 1 and blocks_equal(got, h.payload(seq, 0, 1)) == []
    finally:
        cluster.master.resume()
        stack.close()
