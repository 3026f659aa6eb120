"""The event stream (``Backend.events``, ``kvcore_watch``): a subscriber is told every object
stored, removed and cleared, in order and with its identity, and under eviction an index
built from the events holds exactly what the store keeps."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from kvcore.events import KINDS, StoreEvent, StoreIndex
from kvcore.keys import ObjectName
from kvcore.requests import BlockRequest
from kvcore.testing.harness import Harness
from kvcore.testing.kit.fixtures import DeclaredCapacity, KitFixtures, _twice_the_capacity
from kvcore.testing.kit.marks import exercises

__all__ = ["EventTests"]


class EventTests(KitFixtures):
    """An index built only from the events matches the store."""

    # -- events ------------------------------------------------------------------------------

    @exercises("kvcore_watch", "kvcore_write", "kvcore_remove", "kvcore_clear")
    def test_events_tell_what_was_stored_removed_and_cleared(
        self, open_harness: Callable[..., Harness]
    ) -> None:
        """The backend's event stream (``Backend.events``): a subscriber sees every object a
        write acknowledged, every object a remove deleted and a clear, in increasing sequence
        numbers, each event naming the backend's namespace and each object's part; writes
        made before it subscribed are not replayed. Works for every backend (kvcore publishes
        what passes through it); a backend that reports kinds itself (``kvcore_watch``) must
        report them as well."""
        h = open_harness(namespace=f"kvcore-kit-{uuid.uuid4().hex[:12]}")
        before = h.new_sequence(2)
        assert h.write(before) == 2
        seq = h.new_sequence(4)
        with h.backend.events.subscribe() as sub:
            acked = int(h.write(seq))
            assert acked == 4, f"write of 4 blocks acknowledged {acked}"
            names = _names(h.request(seq))
            index = StoreIndex()
            events = _take_events(h, sub, lambda: set(names) <= set(index.objects), index)
            stored = {n for e in events if e.kind == "stored" for n in e.names}
            assert set(names) <= stored, (
                f"stored events name {len(stored & set(names))} of the {len(names)} objects "
                "the write acknowledged"
            )
            assert not stored & set(_names(h.request(before))), (
                "a subscriber was told of writes made before it subscribed"
            )
            for e in events:
                _check_event(e, h.backend.context.namespace)
            if h.backend.implements("kvcore_remove"):
                assert h.backend.remove(h.request(seq, 2, 2)) == 2
                gone = set(_names(h.request(seq, 2, 2)))
                events += _take_events(h, sub, lambda: not gone & set(index.objects), index)
                assert not gone & set(index.objects), (
                    "after a remove, an index built from the events still holds "
                    f"{sorted(gone & set(index.objects))}"
                )
            if h.backend.implements("kvcore_clear"):
                assert h.backend.clear() >= 0
                events += _take_events(h, sub, lambda: not set(index.objects), index)
                assert not index.objects, (
                    f"after a clear, an index built from the events still holds "
                    f"{len(index.objects)} objects"
                )
            seqs = [e.seq for e in events]
            assert seqs == sorted(set(seqs)), f"sequence numbers do not increase: {seqs}"

    @exercises("kvcore_watch", "kvcore_write", "kvcore_query")
    def test_events_match_what_the_store_keeps_under_eviction(
        self,
        open_harness: Callable[..., Harness],
        backend_capacity: DeclaredCapacity | None,
    ) -> None:
        """For a backend that reports its own drops (``kvcore_watch``): write about twice its
        capacity; an index built only from the events then holds exactly the blocks a query
        finds (no block reported stored that is gone, none kept that was never reported)."""
        h, n = _twice_the_capacity(open_harness, backend_capacity)
        if not h.backend.implements("kvcore_watch"):
            pytest.skip("backend does not report what it drops (kvcore_watch, kvcore 0.3)")
        seqs = [h.new_sequence(4) for _ in range(max(1, n // 4))]
        with h.backend.events.subscribe() as sub:
            for seq in seqs:
                h.write(seq)
            index = StoreIndex()
            index.apply_all(sub.drain())
            wrong = []
            for seq in seqs:
                for i in range(len(seq.keys)):
                    held = bool(h.query(seq, i, 1))
                    told = set(_names(h.request(seq, i, 1))) <= set(index.objects)
                    if held != told:
                        wrong.append((seq.keys[i][:12], held, told))
            assert not wrong, (
                f"{len(wrong)} blocks where the store and the events disagree "
                f"(key, held, told by events): {wrong[:5]}"
            )
            assert index.resyncs == 0, "the subscription fell behind (resync) in a short test"


# -- helpers ---------------------------------------------------------------------------------


def _names(request: BlockRequest) -> list[str]:
    return [name for row in request.object_names for name in row]


def _take_events(
    h: Harness,
    sub: Any,
    done: Callable[[], bool],
    index: StoreIndex,
    timeout_s: float = 5.0,
) -> list[StoreEvent]:
    """Events from ``sub``, applied to ``index``, until ``done()`` (events a backend reports
    from its own threads may arrive a moment after the call that caused them)."""
    taken: list[StoreEvent] = []
    deadline = time.monotonic() + timeout_s
    while True:
        got = sub.drain()
        index.apply_all(got)
        taken += got
        if done() or time.monotonic() > deadline:
            return taken
        time.sleep(0.01)


def _check_event(event: StoreEvent, namespace: str) -> None:
    assert event.kind in KINDS, f"event kind {event.kind!r}"
    assert event.namespace == namespace, (
        f"event of namespace {event.namespace!r} on a backend opened for {namespace!r}"
    )
    assert len(event.sizes) == len(event.names) == len(event.parts) == len(event.objects), event
    for name, part, obj in zip(event.names, event.parts, event.objects, strict=True):
        # the identity the event carries is the name's, whoever built it
        assert obj is not None and obj.part == part and obj.format() == name, (name, part, obj)
        assert ObjectName.parse(name) == obj, (name, obj)
