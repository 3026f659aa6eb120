"""kvcore.events: the stream, its bounded subscriptions, the reference index, the facade's part
and the ``kvcore_watch`` hook."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest

import kvcore
from kvcore import events as ev
from kvcore.backend import BackendContractError
from kvcore.facade_events import FacadeEvents
from kvcore.memory_backend import MemoryBackend
from kvcore.testing import Harness, small_layout


def names(*pairs: tuple[str, str], ns: str = "ns", scope: str = "/r0of1") -> list[str]:
    return [f"{ns}/{key}/{part}{scope}" for key, part in pairs]


def test_no_subscriber_means_no_event_is_built() -> None:
    stream = ev.EventStream("ns")
    assert not stream.active
    stream.publish(ev.STORED, ["anything"], [1])  # dropped at once
    with stream.subscribe() as sub:
        assert sub.drain() == []


def test_events_carry_sequence_parts_sizes_and_weight_version() -> None:
    stream = ev.EventStream("ns")
    with stream.subscribe() as sub:
        stream.publish(ev.STORED, names(("a", "k"), ("a", "v")), [10, 20])
        # names of two weight versions: one event each, in order
        mixed = [*names(("b", "k"), scope="/r0of1/w1"), *names(("c", "k"), scope="/r0of1/w2")]
        stream.publish(ev.EVICTED, mixed, None, origin=ev.PEER)
        stream.publish(ev.CLEARED)
        got = sub.drain()
    assert [e.seq for e in got] == [1, 2, 3, 4]
    assert [e.kind for e in got] == ["stored", "evicted", "evicted", "cleared"]
    assert got[0].parts == ("k", "v") and got[0].sizes == (10, 20)
    assert [e.weight_version for e in got[1:3]] == ["1", "2"]
    assert got[1].origin == "peer" and got[1].sizes == (0,)
    assert got[3].names == () and got[3].namespace == "ns"
    assert json.loads(json.dumps(got[0].to_dict()))["names"] == list(got[0].names)


def test_names_kvcore_did_not_build_have_no_part() -> None:
    stream = ev.EventStream("ns")
    with stream.subscribe() as sub:
        stream.publish(ev.STORED, ["fastdeploy_key_0_k", "x/y"], [1, 2])
        (event,) = sub.drain()
    assert event.parts == ("", "") and event.weight_version == ""


def test_bad_publications_are_refused() -> None:
    stream = ev.EventStream("ns")
    with stream.subscribe():
        with pytest.raises(ValueError, match="kind 'gone'"):
            stream.publish("gone", ["a"])
        with pytest.raises(ValueError, match="2 sizes for 1 names"):
            stream.publish(ev.STORED, ["a"], [1, 2])


def test_a_slow_subscriber_gets_one_resync_never_a_silent_gap() -> None:
    stream = ev.EventStream("ns")
    slow = stream.subscribe(max_objects=5)
    fast = stream.subscribe()
    for i in range(4):
        stream.publish(ev.STORED, names((f"k{i}", "k"), (f"k{i}", "v")), [1, 1])
    got = slow.drain()
    # 2 + 2 objects fit, the third event would pass 5: the queue becomes resync + that event
    assert [e.kind for e in got] == ["resync", "stored", "stored"]
    seqs = [e.seq for e in got]
    assert seqs == sorted(set(seqs)) and got[-1].seq == 4
    assert slow.resyncs == 1
    index = ev.StoreIndex()
    index.apply_all(got)
    assert index.resyncs == 1 and set(index.objects) == set(got[1].names + got[2].names)
    assert len(fast.drain()) == 4  # another subscriber is unaffected
    slow.close()
    fast.close()


def test_an_event_larger_than_the_queue_is_a_resync_alone() -> None:
    stream = ev.EventStream("ns")
    with stream.subscribe(max_objects=2) as sub:
        stream.publish(ev.STORED, names(("a", "k"), ("b", "k"), ("c", "k")), [1, 1, 1])
        (only,) = sub.drain()
    assert only.kind == "resync" and only.seq == 1


def test_get_waits_and_close_ends_iteration() -> None:
    stream = ev.EventStream("ns")
    sub = stream.subscribe()
    assert sub.get(timeout=0.01) is None
    threading.Timer(0.05, stream.publish, args=(ev.CLEARED,)).start()
    assert sub.get(timeout=5).kind == "cleared"
    threading.Timer(0.05, stream.close).start()
    assert list(sub) == []
    with pytest.raises(RuntimeError, match="closed"):
        stream.subscribe()


def test_the_index_follows_stores_removals_and_clears() -> None:
    index = ev.StoreIndex()
    a, b = names(("a", "k"), ("a", "v")), names(("b", "k"))
    index.apply(ev.StoreEvent(1, ev.STORED, "ns", tuple(a + b), (1, 2, 3)))
    assert index.blocks() == {("ns", "a", 0, 1, "")}  # b has no v part
    index.apply(ev.StoreEvent(2, ev.EVICTED, "ns", tuple(a[:1])))
    assert index.blocks() == set() and len(index) == 2 and b[0] in index
    index.apply(ev.StoreEvent(3, ev.CLEARED, "ns"))
    assert len(index) == 0 and index.last_seq == 3


# -- the facade --------------------------------------------------------------------------------


@pytest.fixture
def memory() -> Harness:
    backend = kvcore.open_backend("memory", context={"layout": small_layout(), "namespace": "m"})
    h = Harness(backend, small_layout())
    yield h
    backend.close()
    h.release()


def request_names(h: Harness, seq, start: int = 0, n: int | None = None) -> list[str]:
    return [x for row in h.request(seq, start, n).object_names for x in row]


def test_the_facade_publishes_writes_removes_and_clears(memory: Harness) -> None:
    h = memory
    seq = h.new_sequence(3)
    with h.backend.events.subscribe() as sub:
        assert h.write(seq) == 3
        assert h.write(seq) == 3  # idempotent: stored again, told again (an index ignores it)
        assert h.backend.remove(h.request(seq, 1, 1)) == 1
        assert h.backend.clear() == 4 + 2  # two blocks of K and V, and their digests
        got = sub.drain()
    assert [e.kind for e in got] == ["stored", "stored", "removed", "cleared"]
    assert list(got[0].names) == request_names(h, seq)
    sizes = [small_layout().part_bytes(p) for p in small_layout().parts]
    assert list(got[0].sizes) == sizes * 3
    assert list(got[2].names) == request_names(h, seq, 1, 1)
    assert all(e.namespace == "m" and e.origin == "local" for e in got)


def test_only_acknowledged_blocks_are_published() -> None:
    # without digests: the count of objects is the test's (a digest is one more per block)
    backend = kvcore.open_backend(
        "memory", {"max_objects": 3}, context={"layout": small_layout()}, verify_blocks="never"
    )
    h = Harness(backend, small_layout())
    seq = h.new_sequence(3)
    with backend.events.subscribe() as sub:
        assert h.write(seq) == 1  # 2 objects a block: the store fills in block 2
        (event,) = sub.drain()
    assert list(event.names) == request_names(h, seq, 0, 1)
    backend.close()
    h.release()


def test_no_subscriber_costs_no_event_work(memory: Harness, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("an event was built with nobody listening")

    monkeypatch.setattr(ev.EventStream, "publish", refuse)
    monkeypatch.setattr(FacadeEvents, "publish_blocks", refuse)
    seq = memory.new_sequence(2)
    assert memory.write(seq) == 2
    assert memory.backend.remove(memory.request(seq)) == 2
    assert memory.backend.clear() == 0


class Watching(MemoryBackend):
    """Reports its writes itself, and one eviction of its own, while watched."""

    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        self.report = None
        self.calls: list[bool] = []

    @kvcore.hookimpl
    def kvcore_watch(self, report):
        self.calls.append(report is not None)
        self.report = report
        return {"stored"}

    @kvcore.hookimpl
    def kvcore_write(self, request):
        n = MemoryBackend.kvcore_write(self, request)
        if self.report is not None and n:
            done = [name for row in request.object_names[:n] for name in row]
            self.report("stored", done, None)
            self.report("evicted", done[:1], None)
        return n


def test_a_watched_backend_reports_its_own_kinds(monkeypatch) -> None:
    # without digests: Watching reports every write it takes, the digests' too
    backend = kvcore.open_backend(
        Watching, context={"layout": small_layout()}, verify_blocks="never"
    )
    h = Harness(backend, small_layout())
    plugin = backend.plugin
    seq = h.new_sequence(2)
    assert h.write(seq) == 2  # nobody listens: the hook was never started
    assert plugin.calls == []
    sub = backend.events.subscribe()
    second = backend.events.subscribe()
    assert plugin.calls == [True]  # once, for the first subscriber
    seq2 = h.new_sequence(2)
    assert h.write(seq2) == 2
    got = sub.drain()
    # "stored" comes from the backend alone (kvcore does not publish it twice)
    assert [e.kind for e in got] == ["stored", "evicted"]
    assert list(got[0].names) == request_names(h, seq2)
    sub.close()
    assert plugin.calls == [True]
    second.close()
    assert plugin.calls == [True, False]  # stopped when the last subscriber left
    backend.close()
    h.release()


def test_bad_reports_are_dropped_and_counted_or_raise_in_strict_mode() -> None:
    for strict in (False, True):
        backend = kvcore.open_backend(Watching, context={"layout": small_layout()}, strict=strict)
        with backend.events.subscribe() as sub:
            report = backend.plugin.report
            if strict:
                with pytest.raises(BackendContractError, match="kind 'gone'"):
                    report("gone", ["x"])
            else:
                report("gone", ["x"])
                report("stored", ["x"], None, "elsewhere")
                assert sub.drain() == []
                assert backend.metrics.snapshot()["invalid_results.watch"] == 2
        backend.close()


def test_closing_the_backend_ends_its_subscriptions_and_stops_watching() -> None:
    backend = kvcore.open_backend(Watching, context={"layout": small_layout()})
    sub = backend.events.subscribe()
    backend.close()
    assert sub.closed and list(sub) == []
    assert backend.plugin.calls == [True, False]


def test_kvcore_events_cli_prints_json_lines(tmp_path) -> None:
    """``kvcore events file`` in one process follows what another process writes."""
    root = str(tmp_path / "store")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcore", "events", "file", "--config",
         json.dumps({"root": root, "rescan_interval_s": 0}), "--namespace", "cli",
         "--count", "2", "--duration", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert "following backend 'file'" in proc.stderr.readline()
        layout = small_layout()
        writer = kvcore.open_backend(
            "file", {"root": root}, context={"layout": layout, "namespace": "cli"}
        )
        h = Harness(writer, layout)
        seq = h.new_sequence(2)
        assert h.write(seq) == 2
        assert writer.remove(h.request(seq, 1, 1)) == 1
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["kind"] for e in events] == ["stored", "removed"], err
    assert events[0]["names"] == request_names(h, seq) and events[0]["origin"] == "peer"
    assert np.diff([e["seq"] for e in events]).tolist() == [1]
    writer.close()
    h.release()


def test_rank_blocks_groups_one_ranks_objects_into_blocks() -> None:
    """kvcore.events.RankBlocks: the one place object events become one rank's block events
    (what vLLM's and SGLang's KV events publish)."""
    from kvcore.keys import object_names

    def names(keys, parts=("k", "v"), rank=0, world=2, ns="m"):
        rows = object_names(keys, parts, namespace=ns, rank=rank, world_size=world)
        return [n for row in rows for n in row]

    def event(kind, objects):
        return ev.StoreEvent(seq=0, kind=kind, namespace="m", names=tuple(objects))

    blocks = ev.RankBlocks("m", ("k", "v"), rank=0, world_size=2, max_partial=1)
    k_only = names(["a"], ("k",))
    assert blocks.changes(event(ev.STORED, k_only)) == []  # half a block is not a block
    assert blocks.changes(event(ev.STORED, names(["a"], ("v",)))) == [ev.BlockChange("stored", "a")]
    others = names(["b"], rank=1) + names(["b"], ns="other") + names(["b"], ("sum",))
    assert blocks.changes(event(ev.STORED, [*others, "engine-own-name"])) == []
    assert blocks.changes(event(ev.EVICTED, names(["a"], ("v",)))) == [
        ev.BlockChange("removed", "a")
    ]
    assert blocks.changes(event(ev.RESYNC, [])) == [ev.BlockChange("cleared", "")]
    # at most max_partial half-stored blocks are remembered, oldest forgotten first
    blocks.changes(event(ev.STORED, names(["c", "d"], ("k",))))
    assert blocks.changes(event(ev.STORED, names(["d"], ("v",)))) == [ev.BlockChange("stored", "d")]
    assert blocks.changes(event(ev.STORED, names(["c"], ("v",)))) == []  # c's k was forgotten


def test_announced_blocks_are_told_once_removed_only_when_told_and_bounded() -> None:
    from kvcore.events import Announced

    told: Announced[str, int] = Announced(limit=3)
    assert told.announce("a", 1) == [] and "a" in told
    assert told.remove("never") is None  # never announced: no removal to tell
    assert told.announce("b", 2) == [] and told.announce("c", 3) == []
    assert told.announce("a", 1) == []  # again: now the newest
    assert told.announce("d", 4) == [2]  # past the bound: the oldest ("b") is withdrawn
    assert "b" not in told and len(told) == 3
    assert told.remove("c") == 3 and told.remove("c") is None  # told once
    assert told.clear() == [1, 4] and len(told) == 0
    with pytest.raises(ValueError, match="limit"):
        Announced(limit=0)


def _write_blocks(backend: kvcore.Backend, keys: list[str]) -> None:
    layout = backend.context.layout
    data = np.zeros(layout.part_bytes("k"), dtype=np.uint8)
    ptr = data.ctypes.data
    host = kvcore.HostBuffers(tuple((ptr, ptr) for _ in keys), (data.nbytes,) * 2)
    assert backend.write(backend.request("w", keys, host=host)) == len(keys)


def _objects(events: list[ev.StoreEvent]) -> list[tuple[str, str]]:
    return [(o.block_key, o.part) for e in events for o in e.objects if o is not None]


def test_a_listing_subscription_announces_the_store_first_then_its_changes() -> None:
    """``subscribe(listing=True)``: what the store held when the subscriber attached comes
    first (``stored`` events of origin ``listed``, without the digests kvcore keeps beside
    blocks), listed at the first take, so a change made between subscribing and that take is
    in the listing or follows it; then the changes."""
    backend = kvcore.open_backend("memory", context={"layout": small_layout(), "namespace": "ns"})
    try:
        assert backend.verifies_blocks  # memory keeps no checksums: digests sit beside blocks
        _write_blocks(backend, ["a", "b", "c"])
        sub = backend.events.subscribe(listing=True, listing_batch=4)
        assert backend.remove(backend.request("r", ["b"])) == 1  # before the first take
        _write_blocks(backend, ["d"])
        events = sub.drain()
        listed = [e for e in events if e.origin == ev.LISTED]
        assert events[: len(listed)] == listed  # the listing first
        assert all(e.kind == ev.STORED and e.seq == 0 for e in listed)
        assert [len(e.names) for e in listed] == [4, 2]  # a, c, d: K and V each; 4 a batch
        assert sorted(_objects(listed)) == sorted(
            (k, p) for k in ("a", "c", "d") for p in ("k", "v")
        )
        changes = events[len(listed) :]
        assert [(e.kind, e.origin) for e in changes] == [("removed", "local"), ("stored", "local")]
        assert sub.listed == 6
        _write_blocks(backend, ["e"])
        (later,) = sub.drain()
        assert later.kind == ev.STORED and later.origin == ev.LOCAL  # listed once only
        sub.close()
    finally:
        backend.close()


def test_a_listing_subscription_lists_again_after_a_resync_and_drains_in_steps() -> None:
    backend = kvcore.open_backend("memory", context={"layout": small_layout(), "namespace": "ns"})
    try:
        _write_blocks(backend, ["a", "b"])
        sub = backend.events.subscribe(max_objects=3, listing=True, listing_batch=1)
        first = sub.drain(max_objects=2)
        assert [len(e.names) for e in first] == [1, 1] and sub.drain(max_objects=1)
        _write_blocks(backend, ["c", "d"])  # 4 objects in one event: past the queue's bound
        events = sub.drain()
        assert events[0].kind == ev.RESYNC  # the consumer forgets what it was told...
        relisted = events[1:]
        assert all(e.origin == ev.LISTED for e in relisted)  # ...and is told the store again
        assert sorted({k for k, _ in _objects(relisted)}) == ["a", "b", "c", "d"]
        assert sub.resyncs == 1 and sub.listed == 4 + 8
        plain = backend.events.subscribe()
        _write_blocks(backend, ["e"])
        assert [e.origin for e in plain.drain()] == [ev.LOCAL]  # no listing unless asked
    finally:
        backend.close()
