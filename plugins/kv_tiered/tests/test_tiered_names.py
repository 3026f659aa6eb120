"""The requests the stack builds itself (a copy some of whose blocks were cancelled, an undo,
an eviction handed down, a peer's removal applied to a private tier, the question whether a
tier above holds an evicted object) carry typed names (``NameRows.typed``) wherever kvcore's
names are: a tier's digests are found by the names' identity, never read back from text."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kvcore
from kvcore.integrity import DIGEST_PART
from kvcore.keys import NameRows
from kvcore.testing import Harness, harness_opener, small_layout


def open_stack(tmp_path, **config: Any) -> Harness:
    tiers = [
        {"backend": "file", "root": str(tmp_path / "near"), "rescan_interval_s": 0},
        {"backend": "file", "root": str(tmp_path / "far"), "rescan_interval_s": 0},
    ]
    layout = small_layout()
    backend = kvcore.open_backend(
        "tiered", {"tiers": tiers, **config}, context={"layout": layout}, strict=True
    )
    return Harness(backend, layout)


def record(tier: kvcore.Backend, op: str) -> list[kvcore.BlockRequest]:
    """Every request the stack passes to ``tier``'s ``op`` from now on."""
    seen: list[kvcore.BlockRequest] = []
    real: Callable[..., Any] = getattr(tier, op)

    def recording(request: kvcore.BlockRequest, *args: Any, **kwargs: Any) -> Any:
        seen.append(request)
        return real(request, *args, **kwargs)

    setattr(tier, op, recording)
    return seen


def typed(request: kvcore.BlockRequest) -> bool:
    names = request.object_names
    return isinstance(names, NameRows) and names.typed


def flush(h: Harness) -> None:
    assert h.backend.plugin.flush(30), "background copies did not finish"


def test_a_copy_some_of_whose_blocks_were_removed_keeps_the_rest_typed(tmp_path) -> None:
    """A remove cancels the queued copies of its blocks; the copy of the others reaches the
    tier below with typed names, and each kept block with its own metadata."""
    h = open_stack(tmp_path)
    far = h.backend.plugin.tiers[1]
    writes = record(far, "write")
    try:
        seq = h.new_sequence(4)
        meta = [b"block-%d" % i for i in range(4)]
        mover = h.backend.plugin._mover
        with mover._cond:  # the workers wait: the write's copy stays queued
            assert h.write(seq, block_meta=meta) == 4
            assert mover.backlog_blocks == 4
            assert h.backend.remove(h.request(seq, 1, 2)) == 2  # blocks 1 and 2
            assert mover.backlog_blocks == 2
        flush(h)
        assert [r.num_blocks for r in writes] == [2]
        assert typed(writes[0]), "the copy's names lost their identity"
        assert list(writes[0].object_names) == [h.request(seq).object_names[i] for i in (0, 3)]
        below = Harness(far, h.layout)
        assert far.describe(below.request(seq, 0, 1)) == [meta[0]]
        assert far.describe(below.request(seq, 3, 1)) == [meta[3]], "block 3 got another's metadata"
    finally:
        h.backend.close()


def test_a_copy_undone_after_a_peers_removal_removes_by_typed_names(tmp_path) -> None:
    h = open_stack(tmp_path)
    other = open_stack(tmp_path)
    try:
        seq = h.new_sequence(3)
        far = h.backend.plugin.tiers[1]
        real_write = far.write
        removes = record(far, "remove")

        def write_after_the_peers_removal(request: kvcore.BlockRequest) -> Any:
            assert other.backend.remove(other.request(seq, 1, 1)) == 1
            return real_write(request)

        far.write = write_after_the_peers_removal
        assert h.write(seq) == 3
        flush(h)
        far.write = real_write
        assert h.backend.stats()["backend_lower_undone_blocks"] == 1
        assert [r.num_blocks for r in removes] == [1] and typed(removes[0])
        assert list(removes[0].object_names) == [h.request(seq, 1, 1).object_names[0]]
    finally:
        h.backend.close()
        other.backend.close()


def test_evicted_blocks_reach_the_tier_below_typed(open_evicting_stack) -> None:
    layout = small_layout()
    # memory below keeps digests beside the blocks (no checksums of its own)
    backend = open_evicting_stack(layout, below={"backend": "memory"})
    h = Harness(backend, layout)
    writes = record(backend.plugin.tiers[1], "write")
    try:
        seqs = [h.new_sequence(2) for _ in range(12)]
        for seq in seqs:
            assert h.write(seq) == 2
        flush(h)
        evicted = [r for r in writes if r.task_id == "tiered-evicted"]
        assert evicted, "nothing was handed down"
        assert all(typed(r) for r in evicted), "handed-down names lost their identity"
        for seq in seqs:  # and every block reads back, verified by the digest found that way
            h.assert_reads_back(seq, 2)
    finally:
        backend.close()


@pytest.fixture
def memory_over_file(tmp_path) -> Iterator[tuple[Harness, Harness]]:
    root = str(tmp_path / "s")
    tiers = [{"backend": "memory"}, {"backend": "file", "root": root}]
    with (
        harness_opener("tiered", {"tiers": tiers}) as stack,
        harness_opener("file", {"root": root}) as peer,
    ):
        yield stack(), peer()


def test_a_peers_removal_takes_the_private_tiers_digests_too(memory_over_file) -> None:
    h, other = memory_over_file
    memory = h.backend.plugin.tiers[0]
    removes = record(memory, "remove")
    seq = h.new_sequence(3)
    assert h.write(seq) == 3
    assert other.backend.remove(other.request(seq, 1, 1)) == 1
    assert h.query(seq) == 1
    assert removes and all(typed(r) for r in removes)
    held = set(memory.plugin._objects)
    digest = h.request(seq, 1, 1).object_names.with_parts((DIGEST_PART,))
    assert digest is not None and digest[0][0] not in held, "the removed block's digest stayed"
    assert not held & set(h.request(seq, 1, 1).object_names[0])


def test_objects_a_private_tier_above_still_holds_are_not_reported_evicted(tmp_path) -> None:
    """The stack reports an eviction of its last tier only for objects no tier above holds;
    a memory tier keeps digests beside its blocks, and holds an object only with its digest,
    which the question finds by the object's identity."""
    layout = small_layout()
    block = 2 * layout.part_bytes("k")
    tiers = [
        {"backend": "memory"},
        {"backend": "file", "root": str(tmp_path / "far"), "capacity_bytes": 6 * block + (32 << 10),
         "rescan_interval_s": 0},
    ]  # fmt: skip
    backend = kvcore.open_backend(
        "tiered", {"tiers": tiers}, context={"layout": layout}, strict=True
    )
    h = Harness(backend, layout)
    try:
        with backend.events.subscribe() as sub:
            seqs = [h.new_sequence(1) for _ in range(20)]
            for seq in seqs:
                assert h.write(seq) == 1
            assert backend.plugin.flush(30)
            assert backend.plugin.tiers[1].stats()["backend_evictions"] > 0
            evicted = [e for e in sub.drain() if e.kind == kvcore.events.EVICTED]
            assert all(h.query(seq) == 1 for seq in seqs)  # the memory tier holds them all
            assert evicted == [], "objects the memory tier holds were reported evicted"
    finally:
        backend.close()
