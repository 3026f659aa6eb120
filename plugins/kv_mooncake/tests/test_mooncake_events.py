"""Events of a Mooncake store: kvcore publishes this client's writes and removals; the backend
reports an eviction as a client can see it: an object it stored, found gone by its own
lookup (Mooncake tells clients nothing when the master evicts or another client removes)."""

from __future__ import annotations

from collections.abc import Callable

from kv_mooncake.testing import MooncakeCluster

import kvcore
from kvcore.events import StoreIndex
from kvcore.testing import Harness, small_layout


def _names(h: Harness, seq, start: int = 0, n: int | None = None) -> list[str]:
    return [x for row in h.request(seq, start, n).object_names for x in row]


def test_drops_this_client_stored_are_reported_when_it_finds_them_gone(
    mooncake_cluster_factory: Callable[..., MooncakeCluster],
) -> None:
    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    layout = small_layout()
    ctx = {"layout": layout, "namespace": "events"}
    mine = kvcore.open_backend("mooncake", cluster.config(), context=ctx)
    other = kvcore.open_backend("mooncake", cluster.config(), context=ctx)
    h, o = Harness(mine, layout), Harness(other, layout)
    try:
        before = h.new_sequence(2)
        assert h.write(before) == 2  # nobody listens yet: not remembered
        seq = h.new_sequence(4)
        with mine.events.subscribe() as sub:
            assert h.write(seq) == 4
            index = StoreIndex()
            index.apply_all(sub.drain())
            assert set(_names(h, seq)) <= set(index.objects)  # stored, from kvcore
            # another client removes blocks 1-2 (and one this client wrote before watching)
            assert other.remove(o.request(seq, 1, 2)) == 2
            assert other.remove(o.request(before)) == 2
            assert sub.drain() == []  # nothing to see until this client looks
            assert h.query(seq) == 1  # the lookup asks for every object: 1 and 2 are gone
            events = sub.drain()
            assert [(e.kind, e.origin) for e in events] == [("evicted", "peer")]
            assert set(events[0].names) == set(_names(h, seq, 1, 2))
            index.apply_all(events)
            assert h.query(seq, 3) == 1
            assert sub.drain() == [], "a drop is reported once"
            held = {n for n in _names(h, seq) if n in index.objects}
            assert held == set(_names(h, seq, 0, 1) + _names(h, seq, 3, 1))
            assert h.query(before) == 0
            assert sub.drain() == [], "a block stored before watching is not remembered"
            # this client's own removal: kvcore publishes it as removed, never evicted later
            assert mine.remove(h.request(seq, 0, 1)) == 1
            assert [e.kind for e in sub.drain()] == ["removed"]
            assert h.query(seq) == 0
            assert sub.drain() == []
    finally:
        mine.close()
        other.close()
        h.release()
        o.release()
