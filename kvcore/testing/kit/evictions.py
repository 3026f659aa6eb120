"""The hand-over of evictions (``kvcore_evict_to``): with about twice a declared capacity
written, every block is either still stored or was handed to the sink with its exact bytes,
and what a sink does not store stays in the store, whole."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from kvcore.tenants import DEFAULT_TENANT
from kvcore.testing.harness import Harness
from kvcore.testing.kit.fixtures import (
    DeclaredCapacity,
    KitFixtures,
    _require_hook,
    _twice_the_capacity,
)
from kvcore.testing.kit.marks import exercises

__all__ = ["EvictionTests"]


class EvictionTests(KitFixtures):
    """A store in front of another loses nothing it evicts, and keeps what was not taken."""

    @exercises("kvcore_evict_to", "kvcore_write", "kvcore_query")
    def test_what_the_store_evicts_is_handed_over_intact(
        self,
        open_harness: Callable[..., Harness],
        backend_capacity: DeclaredCapacity | None,
    ) -> None:
        """For a backend with ``kvcore_evict_to``: write about twice its capacity; every block
        written is then either still found, or was handed to the sink with every part's exact
        bytes (a store in front of another loses nothing it evicts)."""
        h, n = _twice_the_capacity(open_harness, backend_capacity)
        _require_hook(h.backend, "kvcore_evict_to")
        handed: dict[str, bytes] = {}

        def sink(objects: list[tuple[str, memoryview]]) -> None:
            for name, payload in objects:
                handed[name] = bytes(payload)  # valid only during the call: copied

        if not h.backend.evict_to(sink):
            pytest.skip("the backend says it cannot hand evictions over (kvcore_evict_to)")
        seqs = [h.new_sequence(4) for _ in range(max(1, n // 4))]
        for seq in seqs:
            assert h.write(seq) == 4
        h.backend.evict_to(None)
        assert handed, f"{len(seqs) * 4} blocks written over a capacity of ~{n // 2}: none handed"
        lost, wrong = [], []
        for seq in seqs:
            names = h.request(seq).object_names
            for i in range(4):
                if h.query(seq, i, 1):
                    continue
                for j, name in enumerate(names[i]):  # each part: still stored, or handed over
                    want = h.payload(seq, i, 1)[0][j]
                    if name in handed:
                        if handed[name] != want:
                            wrong.append(name)
                        continue
                    part = h.parts[j]
                    one = h.backend.request(
                        "kit-part", [seq.keys[i]], parts=(part,),
                        part_bytes=(h.layout.part_bytes(part),),
                    )  # fmt: skip
                    if not h.backend.query(one):
                        lost.append(name)
        assert not lost, f"{len(lost)} evicted objects were never handed over: {lost[:3]}"
        assert not wrong, f"{len(wrong)} objects were handed over with other bytes: {wrong[:3]}"

    @exercises("kvcore_evict_to", "kvcore_write", "kvcore_query")
    def test_what_the_sink_does_not_store_stays_in_the_store(
        self,
        open_harness: Callable[..., Harness],
        backend_capacity: DeclaredCapacity | None,
    ) -> None:
        """For a backend with ``kvcore_evict_to``: with a sink that stores nothing (a lower
        tier that is down), write about twice the capacity. Every block a write acknowledged
        is still found whole, no block is left with some of its parts, and each offer came
        with the write's deadline and held a block's parts together."""
        h, n = _twice_the_capacity(open_harness, backend_capacity)
        _require_hook(h.backend, "kvcore_evict_to")
        offers: list[tuple[list[str], float | None]] = []

        def sink(objects: list[tuple[str, memoryview]], deadline: float | None) -> list[str]:
            offers.append(([name for name, _ in objects], deadline))
            return []  # stored nothing: nothing may leave

        if not h.backend.evict_to(sink):
            pytest.skip("the backend says it cannot hand evictions over (kvcore_evict_to)")
        try:
            acked = []
            for _ in range(max(1, n // 4)):
                seq = h.new_sequence(4)
                acked.append((seq, int(h.write(seq))))
        finally:
            h.backend.evict_to(None)
        assert offers, f"{n} blocks written over a capacity of ~{n // 2}: nothing offered"
        assert all(deadline is not None for _, deadline in offers), "an offer without deadline"
        lost, split = [], []
        for seq, done in acked:
            names = h.request(seq).object_names
            for i in range(len(seq.keys)):
                found = [
                    bool(h.backend.query(h.backend.request(
                        "kit-part", [seq.keys[i]], parts=(p,),
                        part_bytes=(h.layout.part_bytes(p),),
                    )))
                    for p in h.parts
                ]  # fmt: skip
                if i < done and not all(found):
                    lost.append(names[i][0])
                elif any(found) and not all(found):
                    split.append(names[i][0])
        assert not lost, f"{len(lost)} acknowledged blocks left though the sink took nothing"
        assert not split, f"{len(split)} blocks left with only some of their parts: {split[:3]}"
        offered = {name for names, _ in offers for name in names}
        for offer, _ in offers:  # a block's parts in one offer
            rows = [r for seq, _ in acked for r in h.request(seq).object_names]
            for row in rows:
                if set(row) & set(offer):
                    assert set(row) <= set(offer), f"block {row[0]} offered part by part"
        assert offered

    @exercises("kvcore_evict_to", "kvcore_write")
    def test_each_offer_names_the_tenant_whose_writes_stored_it(
        self,
        open_harness: Callable[..., Harness],
        backend_capacity: DeclaredCapacity | None,
    ) -> None:
        """For a backend with ``kvcore_evict_to``: write about twice the capacity as two
        tenants in turn; each object offered to a sink that takes ``tenant`` is offered as
        the tenant whose write stored it (the tier below then keeps it as theirs: its shares,
        figures and ``clear --tenant``). A store that keeps no tenants (no
        ``kvcore_clear_tenant``) offers every object as the default tenant's: the test then
        has nothing to check, and skips.

        .. versionadded:: 0.3"""
        h, n = _twice_the_capacity(open_harness, backend_capacity)
        _require_hook(h.backend, "kvcore_evict_to")
        offered: dict[str, str] = {}

        def sink(
            objects: list[tuple[str, memoryview]], deadline: float | None, tenant: str
        ) -> list[str]:
            offered.update((name, tenant) for name, _ in objects)
            return [name for name, _ in objects]

        if not h.backend.evict_to(sink):
            pytest.skip("the backend says it cannot hand evictions over (kvcore_evict_to)")
        tenants = [f"kit-{uuid.uuid4().hex[:12]}" for _ in range(2)]
        whose: dict[str, str] = {}
        try:
            for k in range(max(2, n // 4)):
                seq, tenant = h.new_sequence(4), tenants[k % 2]
                whose.update((name, tenant) for row in h.request(seq).object_names for name in row)
                h.write(seq, tenant=tenant)
        finally:
            h.backend.evict_to(None)
        mine = {name: t for name, t in offered.items() if name in whose}
        assert mine, f"{n} blocks written over a capacity of ~{n // 2}: nothing offered"
        if set(mine.values()) == {DEFAULT_TENANT} and not h.backend.implements(
            "kvcore_clear_tenant"
        ):  # a backend that can clear a tenant knows whose each object is: it must say
            pytest.skip("the backend keeps no tenants: it offers every object as the default's")
        wrong = [name for name, t in mine.items() if t != whose[name]]
        assert not wrong, (
            f"{len(wrong)} of {len(mine)} objects offered as another tenant's: {wrong[0]} as "
            f"{mine[wrong[0]]!r}, written by {whose[wrong[0]]!r}"
        )
