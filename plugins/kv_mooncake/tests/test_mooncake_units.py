"""Pieces that need no master: key encoding, region bookkeeping, chunking, code mapping."""

from __future__ import annotations

import logging
import re
import time

import pytest
from kv_mooncake import MooncakeBackend, MooncakeConfig
from kv_mooncake.backend import _chunks, _Objects
from kv_mooncake.codes import reason
from kv_mooncake.inflight import PieceBudget
from kv_mooncake.regions import RegionTable, merge_spans
from kv_mooncake.store_keys import MAX_PLAIN_KEY, namespace_pattern, namespace_prefix, store_key

from kvcore import BlockRequest, Counters, OnceLogger, leading_run
from kvcore.keys import object_name


def test_plain_names_pass_unchanged() -> None:
    name = object_name("ab" * 32, "k_scale", namespace="default", rank=1, world_size=4)
    assert store_key(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a\x00b",
        "../../etc/passwd",
        "/abs",
        ".",
        "..",
        "a//b",
        "名前",
        "x\n",
        "x" * 10_000,
        "#sha256:00",
        "\udc80",
    ],
)
def test_unsafe_names_are_hashed_under_the_namespace(name: str) -> None:
    key = store_key(name, "default")
    assert key.startswith("default/#sha256:") and len(key) == len("default/#sha256:") + 64
    assert key == store_key(name, "default")  # stable


def test_hashing_keeps_names_apart() -> None:
    names = ["x" * (MAX_PLAIN_KEY + 1), "x" * (MAX_PLAIN_KEY + 2), "a\x00b", "a\x00c"]
    assert len({store_key(n, "default") for n in names}) == len(names)
    longest = "default/" + "x" * (MAX_PLAIN_KEY - len("default/"))
    assert store_key(longest, "default") == longest


@pytest.mark.parametrize("namespace", ["default", "model-a", "", "a/b", "..", "名前", "#ns-x"])
def test_every_key_of_a_namespace_is_under_its_prefix_and_no_other(namespace: str) -> None:
    others = ["default", "model-a", "model", "a", "", "a/b", "#ns-x"]
    names = [
        object_name("ab" * 32, "k", namespace=namespace, rank=0, world_size=1),
        object_name("../" * 100, "v", namespace=namespace, rank=3, world_size=4),
        "no namespace at all",
    ]
    pattern = re.compile(namespace_pattern(namespace))
    for name in names:
        key = store_key(name, namespace)
        assert key.startswith(namespace_prefix(namespace)) and pattern.match(key), key
        for other in (o for o in others if o != namespace):
            assert not re.match(namespace_pattern(other), key), (other, key)


class FakeMooncake:
    """Registration calls as Mooncake answers them: overlapping registrations are refused."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.calls: list[str] = []

    def register(self, ptr: int, n: int) -> int:
        self.calls.append(f"reg {ptr} {n}")
        if any(ptr < p + m and p < ptr + n for p, m in self.live.items()):
            return -600
        self.live[ptr] = n
        return 0

    def unregister(self, ptr: int) -> int:
        self.calls.append(f"unreg {ptr}")
        return 0 if self.live.pop(ptr, None) is not None else -600


@pytest.fixture
def table() -> tuple[RegionTable, FakeMooncake]:
    fake = FakeMooncake()
    return RegionTable(fake.register, fake.unregister), fake


def test_merge_spans() -> None:
    assert merge_spans([(10, 20), (0, 5), (5, 8), (15, 30), (40, 41)]) == [
        (0, 8),
        (10, 30),
        (40, 41),
    ]


def test_spans_inside_a_registered_region_need_no_registration(table) -> None:
    t, fake = table
    assert t.add(1000, 1000) == 0
    pinned, unregistered = t.pin([(1000, 1100), (1500, 2000)])
    assert (pinned, unregistered) == ([], 0)
    assert fake.calls == ["reg 1000 1000"]
    assert t.remove(1000) == 0 and fake.live == {}
    assert t.remove(1000) == -600


def test_temporary_registration_is_shared_and_released(table) -> None:
    t, fake = table
    first, _ = t.pin([(0, 100), (100, 200)])  # touching spans: one registration
    second, _ = t.pin([(50, 150)])  # inside the first: reused, not registered again
    assert fake.live == {0: 200} and len(first) == 1 and second == first
    t.unpin(first)
    assert fake.live == {0: 200}  # still used by the second call
    t.unpin(second)
    assert fake.live == {} and t.count == 0


def test_a_call_in_flight_when_the_client_closes_releases_nothing_twice(table) -> None:
    t, fake = table
    pinned, _ = t.pin([(0, 100)])
    t.clear()  # the client closes while the call is in flight
    t.unpin(pinned)  # raised IndexError before
    assert fake.calls == ["reg 0 100"] and t.count == 0


def test_a_transfer_unpins_in_the_table_it_pinned_in_when_a_close_replaces_it() -> None:
    """Seen under load: a tier stack abandoned an eviction write at its deadline and closed
    its Mooncake tier; the write, still in flight, then unpinned its buffers in the closed
    client's new (empty) table and failed with IndexError. Reads and writes share the path."""

    class ClosingStore:
        def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
            backend._regions = RegionTable(lambda p, n: -1, lambda p: -1)  # what a close does
            return list(sizes)

    backend = bare_backend(ClosingStore())
    pinned_in = backend._regions
    ok, code = backend._transfer("read", ["a"], _Objects([4096], [8]), a_request(1, 5.0))
    assert (ok, code) == ([True], None)
    assert pinned_in.count == 0  # released where it was pinned


def test_overlap_with_a_known_region_stays_unregistered(table) -> None:
    t, fake = table
    assert t.add(100, 100) == 0
    pinned, unregistered = t.pin([(150, 250)])
    assert pinned == [] and unregistered == 1
    assert t.add(150, 10) == -600  # refused without asking Mooncake
    assert fake.calls == ["reg 100 100"]


def test_chunks_split_by_bytes_and_keys() -> None:
    assert _chunks([10] * 5, 25, 100) == [(0, 3), (3, 5)]
    assert _chunks([100, 1, 1], 50, 100) == [(0, 1), (1, 3)]
    assert _chunks([], 10, 100) == []
    assert _chunks([1] * 5, 1000, 2) == [(0, 2), (2, 4), (4, 5)]
    # segmented objects: the bound is on pieces (Mooncake fails a call beyond 2048 of them)
    assert _chunks([1] * 5, 1000, 16, [8] * 5) == [(0, 2), (2, 4), (4, 5)]
    assert _chunks([1] * 4, 1000, 16, [8, 4, 4, 8]) == [(0, 3), (3, 4)]
    assert _chunks([1] * 2, 1000, 4, [9, 9]) == [(0, 1), (1, 2)]  # a key larger than the bound


def test_codes_map_to_reasons() -> None:
    assert [reason(c) for c in (-200, -704, -706, -900, -901, -12345)] == [
        "no_space",
        "not_found",
        "has_lease",
        "rpc_failed",
        "rpc_timeout",
        "other",
    ]


class InFlightStore:
    """Object "b" answers -703 (another writer's put in flight) a few times, then data."""

    def __init__(self, not_ready_times: int) -> None:
        self.not_ready_times = not_ready_times
        self.calls: list[list[str]] = []

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self.calls.append(list(keys))
        busy = "b" in keys and self.not_ready_times > 0
        self.not_ready_times -= busy
        return [-703 if busy and k == "b" else s for k, s in zip(keys, sizes, strict=True)]


def bare_backend(store: object, **config: object) -> MooncakeBackend:
    backend = MooncakeBackend.__new__(MooncakeBackend)  # no client: the store is a fake
    backend.config = MooncakeConfig.load({"master_server_address": "h:1", **config})
    backend._store = store
    backend._payload = None
    backend._counters = Counters()
    backend._warnings = OnceLogger(logging.getLogger("test"))
    backend._regions = RegionTable(lambda p, n: 0, lambda p: 0)
    backend._pieces = PieceBudget(2048)
    backend._max_call_pieces = 1024
    return backend


def a_request(n_keys: int, timeout_s: float) -> BlockRequest:
    return BlockRequest(
        task_id="t",
        block_keys=tuple(f"b{i}" for i in range(n_keys)),
        object_names=tuple((f"b{i}",) for i in range(n_keys)),
        parts=("k",),
        deadline=time.monotonic() + timeout_s,
    )


def test_read_waits_for_a_put_in_flight() -> None:
    store = InFlightStore(not_ready_times=3)
    backend = bare_backend(store)
    ok, code = backend._transfer(
        "read", ["a", "b", "c"], _Objects([0, 8, 16], [8, 8, 8]), a_request(3, 5.0)
    )
    assert (ok, code) == ([True, True, True], None)
    assert store.calls[1:] == [["b", "c"]] * 3  # retries start at the object not ready
    assert backend._counters.snapshot()["waits_replica_not_ready"] == 3


def test_waiting_for_a_put_in_flight_stops_at_the_deadline() -> None:
    store = InFlightStore(not_ready_times=10**6)
    backend = bare_backend(store)
    ok, code = backend._transfer(
        "read", ["a", "b", "c"], _Objects([0, 8, 16], [8, 8, 8]), a_request(3, 0.2)
    )
    assert store.not_ready_times > 0  # stopped by the deadline (0.2 s), not by the store
    assert ok == [True, False, True] and leading_run(ok) == 1
    assert code is None, "still in flight at the deadline: a deadline, not a backend failure"
    assert backend._counters.snapshot()["miss_replica_not_ready"] == 1


def test_as_is_keys_are_the_names_themselves_when_plain():
    """key_scheme="as_is": another client naming keys the same way (FastDeploy's
    MooncakeStore) finds the same objects; anything not plain is still hashed."""
    from kv_mooncake.store_keys import store_key, store_key_as_is

    plain = "prefixRL-STEP5_0123abcd_0_key"
    assert store_key_as_is(plain) == plain
    assert store_key(plain, "default") != plain  # namespaced: under the namespace's prefix
    odd = "a/../b\nc"
    assert store_key_as_is(odd).startswith("#sha256:") and store_key_as_is(odd) != odd
    from kv_mooncake.config import MooncakeConfig

    config = MooncakeConfig(master_server_address="127.0.0.1:1", key_scheme="as_is")
    assert config.key_scheme == "as_is"


def test_the_piece_budget_admits_what_fits_and_times_out_otherwise() -> None:
    budget = PieceBudget(10)
    assert budget.acquire(6, 0.0) and budget.acquire(4, 0.0)
    t0 = time.monotonic()
    assert not budget.acquire(1, 0.05), "full: waits, then gives up at the timeout"
    assert 0.04 < time.monotonic() - t0 < 5.0  # (nobody releases: without the timeout, forever)
    budget.release(4)
    assert budget.acquire(50, 0.0) is False  # clamped to the limit (10), and 6 are taken
    budget.release(6)
    assert budget.acquire(50, 0.0) and budget.in_flight == 10  # a call larger than the queue


_CYCLES_SCRIPT = """
import json, os, sys, time
import kvcore
config = json.loads(sys.argv[1])
layout = kvcore.CacheLayout(num_layers=2, num_heads=2, block_size=16, head_dim=64)
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
def threads():
    # the fewest over a second: a closed client's native thread may still be exiting when
    # first counted (seen once on a loaded machine: +1); a leaked one stays in every count
    counts = []
    for _ in range(20):
        counts.append(len(os.listdir("/proc/self/task")))
        time.sleep(0.05)
    return min(counts)
samples = []
for i in range(17):
    backend = kvcore.open_backend("mooncake", config, context={"layout": layout, "namespace": "c"})
    backend.close()
    if i in (4, 16):
        samples.append((rss_mb(), threads()))
print("CYCLES " + json.dumps(samples))
"""


def test_opening_and_closing_leaks_nothing(mooncake_config) -> None:
    """16 open/close cycles in one process: RSS and threads flat after the first few (a closed
    client stayed referenced until the cyclic garbage collector ran: +274 MB, +1 thread)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _CYCLES_SCRIPT, json.dumps(mooncake_config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("CYCLES ")]
    assert line, proc.stderr[-3000:]
    (rss4, threads4), (rss16, threads16) = json.loads(line[-1][7:])
    assert rss16 - rss4 < 16, f"RSS grew {rss16 - rss4:.0f} MB over 12 cycles"
    assert threads16 <= threads4, f"threads {threads4} -> {threads16}"


def test_block_metadata_companions_verify_and_name_their_object() -> None:
    from kv_mooncake import block_meta

    name = object_name("cd" * 32, "kv", namespace="ns", rank=0, world_size=1)
    blob = block_meta.encode(name, b"\x00meta\xff" * 300)
    assert block_meta.decode(blob) == (name, b"\x00meta\xff" * 300)
    assert block_meta.decode(block_meta.encode("n\udcff", b"")) == ("n\udcff", b"")
    for i in (0, 5, len(blob) // 2, len(blob) - 1):  # a flipped bit anywhere: no metadata
        bad = bytearray(blob)
        bad[i] ^= 0x10
        assert block_meta.decode(bytes(bad)) is None
    assert block_meta.decode(blob[:-1]) is None
    assert block_meta.decode(blob + b"\x00") is None
    assert block_meta.decode(b"") is None
    key = store_key(name, "ns")
    assert block_meta.is_meta_key(block_meta.meta_key(key))
    assert not block_meta.is_meta_key(key)
    assert not block_meta.is_meta_key(store_key("x" * 500, "ns"))  # a digest key ends in hex


class _FakeListing:
    """A store listing whose contents the test sets."""

    url = "http://127.0.0.1:1/metrics"

    def __init__(self, names: set[str]) -> None:
        self.now = set(names)

    def names(self) -> dict[str, str]:
        return {n: n for n in self.now}


def test_a_listing_between_a_local_change_and_its_report_leaves_it_to_the_report() -> None:
    """Seen on a busy CI machine: this client removed an object, a listing round ran before
    the removal was reported, took it for another client's removal, and the local report then
    found nothing to say. A change under way is left to its own report."""
    from kv_mooncake.watch import StoreWatch

    from kvcore import events as ev

    listing = _FakeListing({"a", "b"})
    watch = StoreWatch(listing, 60.0, Counters(), OnceLogger(logging.getLogger("test")))  # type: ignore[arg-type]
    reported: list[tuple[str, list[str], str]] = []
    watch.watch(lambda kind, names, sizes, origin: reported.append((kind, list(names), origin)))
    try:
        with watch.changing(["a"]):
            listing.now.discard("a")  # the store has removed it...
            watch._round()  # ...and a listing round runs before the removal is reported
            watch.removed(["a"])
        with watch.changing(["c"]):
            listing.now.add("c")
            watch._round()
            watch.stored(["c"], [8])
        listing.now.discard("b")  # another client's removal
        watch._round()
    finally:
        watch.close()
    assert reported == [
        (ev.REMOVED, ["a"], ev.LOCAL),
        (ev.STORED, ["c"], ev.LOCAL),
        (ev.REMOVED, ["b"], ev.PEER),
    ]
