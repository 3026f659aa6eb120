"""Events of a Mooncake store.

With the master's HTTP port (the default), the backend lists the store and its stream
describes the whole store: this client's changes as it makes them, other clients' stores and
removals within ``watch_interval_s``. Without it, kvcore publishes this client's writes and
removals, and the backend reports an eviction as a client can see it: an object it stored,
found gone by its own lookup (Mooncake tells clients nothing when the master evicts or another
client removes)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
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
    unlisted = cluster.config(master_metrics_port=None)  # the store cannot be listed
    mine = kvcore.open_backend("mooncake", unlisted, context=ctx)
    other = kvcore.open_backend("mooncake", unlisted, context=ctx)
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


def _drain_until(sub, done: Callable[[list], bool], timeout_s: float = 5.0) -> list:
    got: list = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got.extend(sub.drain())
        if done(got):
            return got
        time.sleep(0.05)
    return got


def test_a_listed_store_reports_every_clients_changes_in_real_time(
    mooncake_cluster_factory: Callable[..., MooncakeCluster],
) -> None:
    """The master's listing makes the stream describe the whole store: another client's stores
    and removals (and clear) arrive within the interval with no lookup by this client; this
    client's own changes arrive as it makes them, once, as local."""
    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    layout = small_layout()
    ctx = {"layout": layout, "namespace": "listed"}
    config = cluster.config(watch_interval_s=0.2)
    mine = kvcore.open_backend("mooncake", config, context=ctx)
    other = kvcore.open_backend("mooncake", config, context=ctx)
    h, o = Harness(mine, layout), Harness(other, layout)
    try:
        before = h.new_sequence(2)
        assert o.write(before) == 2
        assert not mine.reports_whole_store  # nobody follows it yet
        with mine.events.subscribe() as sub:
            assert mine.reports_whole_store
            # stored before the subscription: listed, not reported
            assert set(_names(h, before)) <= set(mine.names())
            seq = h.new_sequence(4)
            start = time.monotonic()
            assert o.write(seq) == 4
            peer = set(_names(h, seq))
            events = _drain_until(sub, lambda got: peer <= {n for e in got for n in e.names})
            took = time.monotonic() - start
            assert {(e.kind, e.origin) for e in events} == {("stored", "peer")}, events
            assert peer <= {n for e in events for n in e.names}, "another client's store unseen"
            assert took < 0.2 + 1.0, f"another client's store reported after {took:.2f} s"
            # another client's removal, with no lookup here
            assert other.remove(o.request(seq, 1, 2)) == 2
            gone = set(_names(h, seq, 1, 2))
            events = _drain_until(sub, lambda got: gone <= {n for e in got for n in e.names})
            assert [(e.kind, e.origin) for e in events] == [("removed", "peer")]
            assert set(events[0].names) == gone
            # this client's own store and removal: reported at once, once, as local
            own = h.new_sequence(1)
            assert h.write(own) == 1
            events = sub.drain()
            assert [(e.kind, e.origin) for e in events] == [("stored", "local")]
            assert set(events[0].names) == set(_names(h, own))
            assert mine.remove(h.request(own)) == 1
            assert [(e.kind, e.origin) for e in sub.drain()] == [("removed", "local")]
            time.sleep(0.6)  # rounds of the listing: nothing is reported twice
            assert sub.drain() == []
            # another client's clear: every object of the namespace reported gone
            index = StoreIndex()
            assert other.clear() > 0
            left = set(_names(h, before) + _names(h, seq, 0, 1) + _names(h, seq, 3, 1))
            events = _drain_until(sub, lambda got: left <= {n for e in got for n in e.names})
            assert {(e.kind, e.origin) for e in events} == {("removed", "peer")}
            assert left <= {n for e in events for n in e.names}
            index.apply_all(events)
            assert mine.names() == []
    finally:
        mine.close()
        other.close()
        h.release()
        o.release()


def test_the_listing_names_digest_keys_by_their_metadata(
    mooncake_cluster_factory: Callable[..., MooncakeCluster],
) -> None:
    """A namespace whose keys are digests of the names (not plain) is listed by the names its
    objects' metadata gives; an object written without metadata cannot be named, and is left
    out rather than guessed."""
    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    layout = small_layout()
    ctx = {"layout": layout, "namespace": "a namespace, not plain"}
    backend = kvcore.open_backend("mooncake", cluster.config(), context=ctx)
    h = Harness(backend, layout)
    try:
        described = h.new_sequence(2)
        assert h.write(described, block_meta=[b"m0", b"m1"]) == 2
        bare = h.new_sequence(1)
        assert h.write(bare) == 1
        listed = set(backend.names())
        assert set(_names(h, described)) <= listed
        assert not set(_names(h, bare)) & listed
        assert backend.describe(h.request(described)) == [b"m0", b"m1"]
    finally:
        backend.close()
        h.release()


def test_an_oversized_companion_blanks_none_of_its_neighbours(
    mooncake_cluster_factory: Callable[..., MooncakeCluster],
) -> None:
    """Issue 62 #6: objects of 15 MiB and 1 MiB under two blocks' companion keys (no
    companion kvcore wrote) overflowed the one copy buffer of a ``get_batch``: the next good
    block's metadata came back None. Each companion is read in its own slot now."""
    from kv_mooncake import block_meta

    cluster = mooncake_cluster_factory(storage_bytes=128 << 20)
    layout = small_layout()
    backend = kvcore.open_backend(
        "mooncake", cluster.config(), context={"layout": layout, "namespace": "big-meta"}
    )
    h = Harness(backend, layout)
    try:
        seq = h.new_sequence(4)
        meta = [b"m0", b"m1", b"m2", b"m3" * 1000]
        assert h.write(seq, block_meta=meta) == 4
        client = backend.plugin._store
        for i, size in ((0, 15 << 20), (1, 1 << 20)):  # the first two blocks' companions
            key = block_meta.meta_key(backend.plugin._key(_names(h, seq, i, 1)[0]))
            assert client.upsert(key, b"x" * size) == 0
        assert backend.describe(h.request(seq)) == [None, None, b"m2", b"m3" * 1000]
        stats = backend.stats()
        assert stats["backend_block_meta_oversized"] == 1  # 15 MiB: not even read
        assert stats["backend_block_meta_unverified"] == 1  # 1 MiB: read alone, no companion
    finally:
        backend.close()
        h.release()


def test_a_watch_started_while_the_master_hangs_reports_what_peers_stored(
    mooncake_cluster_factory: Callable[..., MooncakeCluster],
) -> None:
    """Issue 62 #2: the listing that seeds a watch failed (the master stopped), and the first
    one that later succeeded became the seed: what peers had stored was never reported, no
    resync either. Now that listing reports it all as stored."""
    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    layout = small_layout()
    ctx = {"layout": layout, "namespace": "late-seed"}
    config = cluster.config(watch_interval_s=0.2, connect_timeout_s=0.5)
    mine = kvcore.open_backend("mooncake", config, context=ctx)
    other = kvcore.open_backend("mooncake", config, context=ctx)
    h, o = Harness(mine, layout), Harness(other, layout)
    try:
        before = h.new_sequence(3)
        assert o.write(before) == 3  # a peer's, before anybody follows the store
        cluster.master.pause()
        try:
            sub = mine.events.subscribe()  # its seed listing fails: the master hangs
        finally:
            cluster.master.resume()
        with sub:
            after = h.new_sequence(2)
            assert o.write(after) == 2
            wanted = set(_names(h, before)) | set(_names(h, after))

            def stored(got: list) -> set[str]:
                return {n for e in got if e.kind == "stored" for n in e.names}

            # within the interval and a listing (a busy machine may need many of them)
            events = _drain_until(sub, lambda got: wanted <= stored(got), timeout_s=120)
            assert wanted <= stored(events), sorted(wanted - stored(events))[:3]
            assert mine.stats()["backend_watch_listing_failed"] >= 1
    finally:
        mine.close()
        other.close()
        h.release()
        o.release()


def test_a_listings_bound_follows_the_clusters_size_not_the_connect_timeout(
    mooncake_cluster_factory: Callable[..., MooncakeCluster],
) -> None:
    """Issue 62 #3: every listing was bounded by ``connect_timeout_s`` (2 s), so a cluster of
    1,000,000 keys (another namespace's) could never be listed and no peer's block was
    reported. The bound is now the connect timeout plus the master's key count times
    LISTING_S_PER_KEY (benchmarks/bench_mooncake_listing.py lists 1,000,000 keys)."""
    from kv_mooncake.listing import LISTING_S_PER_KEY

    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    layout = small_layout()
    config = cluster.config(watch_interval_s=0.2, connect_timeout_s=0.5)
    mine = kvcore.open_backend("mooncake", config, context={"layout": layout, "namespace": "me"})
    other = kvcore.open_backend(
        "mooncake", config, context={"layout": layout, "namespace": "crowd"}
    )
    try:
        client = other.plugin._store
        for lo in range(0, 20_000, 1000):  # another namespace's keys, tiny values
            keys = [f"crowd/{i}" for i in range(lo, lo + 1000)]
            assert client.put_batch(keys, [b"v" * 16] * len(keys)) == 0
        listing = mine.plugin._listing
        assert listing.bound_s() >= 0.5 + 20_000 * LISTING_S_PER_KEY
        h = Harness(mine, layout)
        seq = h.new_sequence(2)
        assert h.write(seq) == 2
        assert set(_names(h, seq)) <= set(mine.names())  # found among 20,000 others
        cluster.master.pause()
        try:  # a master that hangs is still told within the connect timeout
            with pytest.raises(OSError):
                listing.bound_s()
        finally:
            cluster.master.resume()
        h.release()
    finally:
        mine.close()
        other.close()
