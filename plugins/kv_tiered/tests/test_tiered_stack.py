"""What a stack does beyond the kit: one call per tier, promotion, write-through, bounded
background copies, faults skipped and counted, corruption served from another tier, remove and
clear reaching every tier, config errors naming the tier."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kv_tiered.mover import Copy

import kvcore
from kvcore import FailureKind
from kvcore.testing import Harness, blocks_equal, harness_opener, small_layout


def open_stack(tmp_path, strict: bool = True, **config: Any) -> Harness:
    """file (near) over file (far): both shared and checksummed, so nothing is followed."""
    tiers = [
        {"backend": "file", "root": str(tmp_path / "near"), "rescan_interval_s": 0},
        {"backend": "file", "root": str(tmp_path / "far"), "rescan_interval_s": 0},
    ]
    layout = small_layout()
    backend = kvcore.open_backend(
        "tiered", {"tiers": tiers, **config}, context={"layout": layout}, strict=strict
    )
    return Harness(backend, layout)


def tier_harness(stack: Harness, i: int) -> Harness:
    return Harness(stack.backend.plugin.tiers[i], stack.layout)


def calls(h: Harness, i: int, op: str) -> float:
    return h.backend.plugin.tiers[i].stats().get(f"calls.{op}", 0.0)


def flush(h: Harness) -> None:
    assert h.backend.plugin.flush(30), "background copies did not finish"


def test_a_query_is_one_call_per_tier_over_the_union(tmp_path) -> None:
    h = open_stack(tmp_path)
    near, far = tier_harness(h, 0), tier_harness(h, 1)
    try:
        seq = h.new_sequence(6)
        assert far.write(seq) == 6  # only the far tier has 0-5 ...
        assert near.write(seq, 0, 2) == 2  # ... and the near one 0-1
        before = (calls(h, 0, "query"), calls(h, 1, "query"))
        assert h.query(seq) == 6
        assert (calls(h, 0, "query"), calls(h, 1, "query")) == (before[0] + 1, before[1] + 1)
        assert h.query(seq, 0, 2) == 2
        assert calls(h, 1, "query") == before[1] + 1, "the far tier was asked for blocks 0-1"
    finally:
        h.backend.close()


def test_a_read_takes_each_block_from_the_fastest_tier_and_promotes_the_rest(tmp_path) -> None:
    h = open_stack(tmp_path)
    near, far = tier_harness(h, 0), tier_harness(h, 1)
    try:
        seq = h.new_sequence(5)
        assert far.write(seq) == 5
        assert near.write(seq, 0, 2) == 2
        done, got = h.read(seq)
        assert done == 5 and blocks_equal(got, h.payload(seq, 0, 5)) == []
        stats = h.backend.stats()
        assert stats["backend_tier0_read_blocks"] == 2 and stats["backend_tier1_read_blocks"] == 3
        flush(h)
        assert near.query(seq) == 5, "blocks 2-4 were not promoted into the near tier"
        # the promotion copied the bytes the read had: the far tier was read once, not twice
        assert h.backend.plugin.tiers[1].metrics.get("blocks_done", "read") == 3
        done, got = h.read(seq)
        assert done == 5 and blocks_equal(got, h.payload(seq, 0, 5)) == []
        stats = h.backend.stats()
        assert stats["backend_tier0_read_blocks"] == 7 and stats["backend_tier1_read_blocks"] == 3
        assert stats["backend_promote_copied_blocks"] == 3
    finally:
        h.backend.close()


def test_a_run_split_back_and_forth_between_tiers_is_read_whole(tmp_path) -> None:
    """Evictions hand blocks down one by one, so a run may be 0-1 below and 2-4 above: every
    block is found, from whichever tier has it, in as many rounds as the run alternates."""
    h = open_stack(tmp_path, promote=False)
    near, far = tier_harness(h, 0), tier_harness(h, 1)
    try:
        seq = h.new_sequence(6)
        assert far.write(seq, 0, 2) == 2
        assert near.write(seq, 2, 3) == 3  # block 5 is nowhere: the run ends at 5
        before = (calls(h, 0, "query"), calls(h, 1, "query"))
        assert h.query(seq) == 5
        # near (miss), far (0-1), near again (2-4), far again (miss at 5)
        assert (calls(h, 0, "query"), calls(h, 1, "query")) == (before[0] + 2, before[1] + 2)
        done, got = h.read(seq)
        assert done == 5 and blocks_equal(got[:5], h.payload(seq, 0, 5)) == []
        stats = h.backend.stats()
        assert stats["backend_tier0_read_blocks"] == 3 and stats["backend_tier1_read_blocks"] == 2
    finally:
        h.backend.close()


def test_write_through_acknowledges_with_the_first_tier_and_fills_the_others(tmp_path) -> None:
    h = open_stack(tmp_path)
    near, far = tier_harness(h, 0), tier_harness(h, 1)
    try:
        seq = h.new_sequence(4)
        assert h.write(seq) == 4
        assert near.query(seq) == 4  # acknowledged: the first tier has it
        flush(h)
        done, got = far.read(seq)
        assert done == 4 and blocks_equal(got, h.payload(seq, 0, 4)) == []
        assert h.backend.stats()["backend_lower_copied_blocks"] == 4
    finally:
        h.backend.close()


def test_background_copies_are_bounded_and_drops_are_counted(tmp_path) -> None:
    h = open_stack(tmp_path, backlog_blocks=3)
    stack = h.backend.plugin
    try:
        mover = stack._mover
        with mover._cond:  # hold the workers: everything submitted now stays queued
            first = h.new_sequence(3)
            second = h.new_sequence(2)
            queued = mover.submit(Copy("lower", 0, (1,), h.request(first), None))
            dropped = not mover.submit(Copy("lower", 0, (1,), h.request(second), None))
            assert queued and dropped
            assert mover.backlog_blocks == 3
        stats = h.backend.stats()
        assert stats["backend_lower_dropped_blocks"] == 2
        assert stats["backend_lower_queued_blocks"] == 3
    finally:
        h.backend.close()


def test_background_copies_wait_for_the_callers_to_pause(tmp_path) -> None:
    """A write-through copy does not run beside the stack's callers: it waits while a call is
    in flight (bounded by copy_yield_s), then runs."""
    h = open_stack(tmp_path, copy_yield_s=5.0)
    far = tier_harness(h, 1)
    activity = h.backend.plugin._activity
    try:
        seq = h.new_sequence(3)
        with activity:  # a caller's call in flight (another thread's read, say)
            assert h.write(seq) == 3
            time.sleep(0.3)
            assert far.query(seq) == 0, "the copy ran beside a call in flight"
        flush(h)
        assert far.query(seq) == 3
        stats = h.backend.stats()
        assert stats["backend_lower_copied_blocks"] == 3
        assert stats.get("backend_lower_unyielded_blocks", 0) == 0

        h.backend.plugin._mover._max_yield_s = 0.2  # under constant load it runs anyway
        more = h.new_sequence(2)
        with activity:
            assert h.write(more) == 2
            deadline = time.monotonic() + 10
            while far.query(more) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert far.query(more) == 2, "a copy waited past copy_yield_s"
        assert h.backend.stats()["backend_lower_unyielded_blocks"] == 2
    finally:
        h.backend.close()


def test_a_promotion_never_runs_past_the_reads_deadline(tmp_path) -> None:
    h = open_stack(tmp_path)
    near, far = tier_harness(h, 0), tier_harness(h, 1)
    try:
        seq = h.new_sequence(2)
        assert far.write(seq) == 2
        past = time.monotonic() - 1
        assert h.backend.plugin._mover.submit(Copy("promote", 1, (0,), h.request(seq), past))
        flush(h)
        assert near.query(seq) == 0
        assert h.backend.stats()["backend_promote_expired_blocks"] == 2
    finally:
        h.backend.close()


def _failing(*args: Any, **kwargs: Any) -> int:
    raise OSError(5, "Input/output error")


def test_a_failing_tier_is_skipped_and_counted_never_failing_the_stack(tmp_path) -> None:
    h = open_stack(tmp_path, strict=False)
    near, far = tier_harness(h, 0), tier_harness(h, 1)
    try:
        seq = h.new_sequence(3)
        near.backend._plain.write_hook = _failing  # the near tier's disk fails
        assert h.write(seq) == 3  # acknowledged by the far tier instead
        assert far.query(seq) == 3 and near.query(seq) == 0
        near.backend._plain.query_hook = near.backend._plain.read_hook = _failing
        assert h.query(seq) == 3
        done, got = h.read(seq)
        assert done == 3 and blocks_equal(got, h.payload(seq, 0, 3)) == []
        stats = h.backend.stats()
        assert stats["backend_tier0_failures_write"] == 1
        assert stats["backend_tier0_failures_query"] >= 1
        assert stats["backend_tier0_failures_read"] == 1
        far.backend._plain.query_hook = far.backend._plain.read_hook = _failing
        assert h.query(seq) == 0  # every tier failed: a counted miss with its reason
        assert h.backend.stats()["failures_reported.query"] >= 1
    finally:
        h.backend.close()


def test_a_corrupt_object_is_removed_there_and_served_from_a_good_copy(tmp_path) -> None:
    h = open_stack(tmp_path)
    near = tier_harness(h, 0)
    try:
        seq = h.new_sequence(3)
        assert h.write(seq) == 3
        flush(h)
        name = h.request(seq).object_names[1][0]
        path = near.backend.plugin._dir.object_path(near.backend.plugin._transfers.digest(name))
        with open(path, "r+b") as f:  # one flipped byte in the payload of block 1, part k
            f.seek(os.path.getsize(path) - 7)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        done, got = h.read(seq)
        assert done == 3 and blocks_equal(got, h.payload(seq, 0, 3)) == []
        assert near.backend.stats()["backend_corrupt_removed"] == 1
        flush(h)  # and the good copy is promoted back
        done, got = near.read(seq)
        assert done == 3 and blocks_equal(got, h.payload(seq, 0, 3)) == []
    finally:
        h.backend.close()


def test_remove_and_clear_reach_every_tier(tmp_path) -> None:
    h = open_stack(tmp_path)
    near, far = tier_harness(h, 0), tier_harness(h, 1)
    try:
        seq = h.new_sequence(4)
        assert h.write(seq) == 4
        assert h.backend.remove(h.request(seq, 2, 2)) == 2  # queued copies are cancelled too
        flush(h)
        assert (near.query(seq), far.query(seq)) == (2, 2)
        assert h.backend.clear() >= 4
        assert (near.query(seq), far.query(seq)) == (0, 0)
    finally:
        h.backend.close()


def test_a_tenants_clear_reaches_every_tier_and_leaves_other_tenants(tmp_path) -> None:
    h = open_stack(tmp_path)
    near, far = tier_harness(h, 0), tier_harness(h, 1)
    try:
        kept, gone = h.new_sequence(3), h.new_sequence(3)
        assert h.write(kept, tenant="A") == 3 and h.write(gone, tenant="B") == 3
        flush(h)  # in both tiers, each tier told whose they are
        assert (near.query(gone), far.query(gone)) == (3, 3)
        removed = h.backend.clear(tenant="B")
        assert removed.failure is None and removed == 2 * 3 * len(h.parts)
        assert (near.query(gone), far.query(gone)) == (0, 0)
        assert (near.query(kept), far.query(kept)) == (3, 3)
        h.assert_reads_back(kept, 3)
        unknown = h.backend.clear(tenant="nobody")
        assert unknown == 0 and "unknown tenant 'nobody'" in str(unknown.failure)
        assert unknown.kind is FailureKind.UNKNOWN_TENANT  # each tier's answer, by its kind
    finally:
        h.backend.close()


def test_blocks_handed_down_on_eviction_stay_their_tenants(open_evicting_stack) -> None:
    """A block the near tier evicts reaches the far tier as its tenant's (kvcore_evict_to's
    ``tenant``): the far tier's figures count it there, and clearing the tenant removes it
    from the far tier too, not only the copies still near."""
    layout = small_layout()
    block = 2 * layout.part_bytes("k")
    backend = open_evicting_stack(layout)
    h = Harness(backend, layout)
    far = tier_harness(h, 1)
    try:
        kept = h.new_sequence(2)
        assert h.write(kept, tenant="A") == 2  # the oldest: evicted first
        gone = [h.new_sequence(2) for _ in range(12)]
        for seq in gone:
            assert h.write(seq, tenant="B") == 2
        flush(h)
        held = far.backend.stats()
        assert far.query(kept) == 2, "A's blocks were not handed down"
        assert held.get("backend_tenant_bytes_held.A", 0) >= 2 * block
        assert held.get("backend_tenant_bytes_held.B", 0) >= 2 * block
        assert held.get("backend_tenant_bytes_held.default", 0) == 0, "handed down as nobody's"
        assert h.backend.clear(tenant="B").failure is None
        assert all(h.query(seq) == 0 for seq in gone), "B's blocks outlived its clear"
        h.assert_reads_back(kept, 2)
    finally:
        backend.close()


@pytest.fixture
def memory_over_file(tmp_path) -> Iterator[tuple[Harness, Harness]]:
    """A stack of memory (this process) over file (shared, write-through), and another
    process's kv_file on that shared directory."""
    root = str(tmp_path / "s")
    tiers = [{"backend": "memory"}, {"backend": "file", "root": root}]
    with (
        harness_opener("tiered", {"tiers": tiers}) as stack,
        harness_opener("file", {"root": root}) as peer,
    ):
        yield stack(), peer()


def test_a_private_tier_follows_removals_in_the_shared_tier_below(memory_over_file) -> None:
    # another process removes a block from the file tier; this stack must not keep serving
    # its memory copy
    h, other = memory_over_file
    seq = h.new_sequence(3)
    assert h.write(seq) == 3
    flush(h)
    assert other.backend.remove(other.request(seq, 1, 2)) == 2
    assert h.query(seq) == 1
    assert h.backend.stats()["backend_invalidations"] == 2 * len(h.layout.parts)


def test_a_write_through_a_private_tier_is_acknowledged_once_the_persistent_tier_has_it(
    memory_over_file,
) -> None:
    """Issue 36 #5: memory over file declared persistent, but acknowledged blocks waited in
    a bounded backlog (46 % dropped at 12,000 blocks; lost at a crash). Now a write is
    acknowledged once the first persistent tier has it: no copy is queued for it."""
    h, other = memory_over_file
    seqs = [h.new_sequence(8) for _ in range(40)]
    for seq in seqs:
        assert h.write(seq) == 8
        assert other.query(seq) == 8, "acknowledged before the file tier had it"
    stats = h.backend.stats()
    assert stats.get("backend_lower_queued_blocks", 0) == 0
    assert stats["backend_tier1_written_blocks"] == 320


@pytest.mark.parametrize("change", ["clear", "remove"])
def test_a_copy_queued_before_a_peers_change_does_not_undo_it(tmp_path, change) -> None:
    # this stack's copy of a write into the far tier is still queued when another process
    # clears both tiers (or removes blocks from them). The copy runs after that, and the
    # blocks must not come back.
    h = open_stack(tmp_path)
    other = open_stack(tmp_path)
    try:
        seq = h.new_sequence(3)
        assert h.write(seq) == 3
        flush(h)  # in both tiers
        mover = h.backend.plugin._mover
        with mover._cond:  # the workers wait: the next write's copy stays queued
            assert h.write(seq) == 3  # offered again (a copy is queued)
            assert mover.backlog_blocks == 3
            if change == "clear":
                assert other.backend.clear() >= 3
            else:
                assert other.backend.remove(other.request(seq, 1, 2)) == 2
        flush(h)
        kept = 0 if change == "clear" else 1
        assert other.query(seq) == kept, f"the copy brought blocks back after the {change}"
        assert h.query(seq) == kept
        assert tier_harness(h, 1).query(seq) == kept
    finally:
        h.backend.close()
        other.backend.close()


def test_a_copy_landing_after_a_peer_removed_its_block_is_undone(tmp_path) -> None:
    # the peer removes the block from every tier while this stack's copy is being written:
    # the copy lands after the removal, and is removed again (the stack saw the removal)
    h = open_stack(tmp_path)
    other = open_stack(tmp_path)
    try:
        seq = h.new_sequence(2)
        far = h.backend.plugin.tiers[1]
        real_write = far.write

        def write_after_the_peers_removal(request):
            assert other.backend.remove(other.request(seq)) == 2
            return real_write(request)

        far.write = write_after_the_peers_removal
        assert h.write(seq) == 2
        flush(h)
        far.write = real_write
        assert h.backend.stats()["backend_lower_undone_blocks"] == 2
        assert tier_harness(h, 1).query(seq) == 0 and h.query(seq) == 0
    finally:
        h.backend.close()
        other.backend.close()


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        ([], "tiers"),
        ([{"backend": "nosuch"}], r"tiers\[0\] \(nosuch\): no kvcore backend named 'nosuch'"),
        ([{"backend": "memory"}, {"backend": "nosuch"}], r"tiers\[1\] \(nosuch\): no kvcore"),
        ([{"backend": "file", "root": "/tmp/kv-one"}, {"backend": "file", "root": "/tmp/kv-one/"}],
         r"tiers\[1\] \(file\): root '/tmp/kv-one/?' is also tiers\[0\]'s"),
        ([{"backend": "memory"}, {"backend": "file", "capacity_bytes": True}],
         r"(?s)tiers\[1\] \(file\).*capacity_bytes: must be a number, not a boolean"),
        ([{"backend": "memory"}, {"backend": "file", "capacity_bytes": "lots"}],
         r"(?s)tiers\[1\] \(file\).*capacity_bytes"),
        ([{"root": "/tmp/x"}], "backend"),
    ],
)  # fmt: skip
def test_a_bad_stack_is_refused_naming_the_tier(tiers, message) -> None:
    with pytest.raises(kvcore.KVCoreError, match=message):
        kvcore.open_backend("tiered", {"tiers": tiers}, context={"layout": small_layout()})


def test_the_stacks_variable_never_reaches_a_nested_stack(tmp_path, monkeypatch) -> None:
    """KVCORE_TIERED_TIERS applied to a nested stack too, which then opened itself again: a
    9 KB RecursionError that never named the variable."""
    import json

    nested = {"backend": "tiered", "tiers": [{"backend": "file", "root": str(tmp_path / "b")}]}
    tiers = [{"backend": "file", "root": str(tmp_path / "a")}, nested]
    monkeypatch.setenv("KVCORE_TIERED_TIERS", json.dumps(tiers))
    with pytest.raises(kvcore.ConfigError) as err:
        kvcore.open_backend("tiered", {"tiers": [{"backend": "memory"}]})
    assert "tiers[1] (tiered): a nested stack while KVCORE_TIERED_TIERS is set" in str(err.value)
    assert len(str(err.value)) < 1000
    monkeypatch.delenv("KVCORE_TIERED_TIERS")
    stack = kvcore.open_backend("tiered", {"tiers": tiers}, context={"layout": small_layout()})
    stack.close()  # without the variable, a nested stack opens


def test_the_stack_declares_what_every_tier_honours(tmp_path) -> None:
    layout = small_layout()
    two_files = [
        {"backend": "file", "root": str(tmp_path / "a")},
        {"backend": "file", "root": str(tmp_path / "b")},
    ]
    file_only = kvcore.open_backend("tiered", {"tiers": two_files}, context={"layout": layout})
    with_memory = kvcore.open_backend(
        "tiered",
        {"tiers": [{"backend": "memory"}, {"backend": "file", "root": str(tmp_path / "c")}]},
        context={"layout": layout},
    )
    try:
        caps = file_only.capabilities
        assert caps.persistent and caps.shared and caps.checksums and caps.segmented_host
        caps = with_memory.capabilities  # memory keeps no checksum: the stack keeps digests
        assert caps.persistent and not caps.shared and caps.checksums
    finally:
        file_only.close()
        with_memory.close()


def test_write_back_on_evict_moves_exactly_what_the_first_tier_evicts(
    tmp_path, open_evicting_stack
) -> None:
    layout = small_layout()
    # about 8 blocks (headers, journal and ledger aside), evicting one object at a time
    backend = open_evicting_stack(layout)
    h = Harness(backend, layout)
    near, far = tier_harness(h, 0), tier_harness(h, 1)
    try:
        seqs = [h.new_sequence(2) for _ in range(15)]
        for seq in seqs:
            assert h.write(seq) == 2
        flush(h)
        evicted = near.backend.stats()["backend_evictions"]
        assert evicted > 0
        assert far.backend.stats()["backend_objects"] == evicted, backend.stats()
        for seq in seqs:  # every block: in one tier or the other, byte for byte
            done, got = h.read(seq)
            assert done == 2 and blocks_equal(got, h.payload(seq, 0, 2)) == []
        flush(h)  # the reads promoted blocks back, evicting others again
        stats = backend.stats()
        assert stats["backend_evicted_written_objects"] == stats["backend_tier0_evictions"]
    finally:
        backend.close()


def test_write_back_on_evict_needs_a_first_tier_that_hands_evictions_over(tmp_path) -> None:
    tiers = [{"backend": "memory"}, {"backend": "file", "root": str(tmp_path / "far")}]
    with pytest.raises(kvcore.ConfigError, match=r"tiers\[0\] \(memory\) cannot hand over"):
        kvcore.open_backend(
            "tiered",
            {"tiers": tiers, "write_policy": "write-back-on-evict"},
            context={"layout": small_layout()},
        )
