"""remove and clear against a live master: every key of a namespace under its prefix (hashed
names and odd namespaces included), leases, and objects of another size healed on read."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kvcore
from kvcore.testing import Harness, blocks_equal, harness_opener, small_layout


@pytest.fixture
def open_h(mooncake_config: dict[str, Any]) -> Iterator[Callable[..., Harness]]:
    with harness_opener("mooncake", mooncake_config) as open_:
        yield open_


def _fresh_namespace() -> str:
    return f"kvtest-{uuid.uuid4().hex[:12]}"


def test_clear_removes_every_key_of_its_namespace_and_no_other(open_h) -> None:
    own_ns = _fresh_namespace()
    # a namespace that extends own's name, and one whose keys are all hashed (it has a "/")
    namespaces = [own_ns, f"{own_ns}x", f"{own_ns}/sub"]
    harnesses = [open_h(namespace=ns) for ns in namespaces]
    plain = harnesses[0].new_sequence(3)
    hostile = harnesses[0].new_sequence(2)
    hostile.keys[:] = [f"../{k}\n" + "x" * 300 for k in hostile.keys]  # hashed names
    for version, h in enumerate(harnesses):
        assert h.write(plain, version=version) == 3
        assert h.write(hostile, version=version) == 2
    own, extended, hashed = harnesses
    assert own.query(plain) == 3  # takes Mooncake's read leases: clear must still work
    removed = own.backend.clear()
    assert removed == 2 * (3 + 2)  # objects: (k, v) x 5 blocks
    assert (own.query(plain), own.query(hostile)) == (0, 0)
    for version, h in enumerate(harnesses[1:], start=1):
        for seq in (plain, hostile):
            done, got = h.read(seq)
            assert done == len(seq.keys), f"clear of {own_ns!r} removed {h.backend.context}"
            assert blocks_equal(got, h.payload(seq, 0, done, version)) == []
    assert hashed.backend.clear() == 10
    assert (hashed.query(plain), hashed.query(hostile)) == (0, 0)
    assert extended.query(plain) == 3
    assert extended.backend.clear() == 10


def test_a_lease_respecting_remove_reports_what_it_could_not_remove(open_h) -> None:
    namespace = _fresh_namespace()
    gentle = open_h({"force_remove": False}, namespace=namespace)
    read_recently = gentle.new_sequence(2)
    untouched = gentle.new_sequence(2)
    assert gentle.write(read_recently) == 2
    assert gentle.write(untouched) == 2  # its existence check found nothing: no lease
    assert gentle.read(read_recently)[0] == 2  # leases the objects for ~10 s
    kept = gentle.backend.remove(gentle.request(read_recently))
    assert kept == 0
    assert "has_lease" in (kept.failure or ""), kept
    assert gentle.query(read_recently) == 2, "a leased object stays"
    removed = gentle.backend.remove(gentle.request(untouched))
    assert (removed, removed.failure) == (2, None)
    assert gentle.query(untouched) == 0
    forced = open_h(namespace=namespace)  # force_remove by default
    assert forced.backend.clear() == 4


@pytest.mark.parametrize("buffers", ["contiguous", "segmented"])
@pytest.mark.parametrize("stored", ["shorter", "longer"])
def test_an_object_of_another_size_is_removed_on_read_and_rewritten(
    open_h, stored: str, buffers: str
) -> None:
    """batch_get_into and the multi-buffer get answer another size differently (a count or
    -600; -800 or -600): both are a miss that removes the object, never a backend failure."""
    namespace = _fresh_namespace()
    short = kvcore.CacheLayout(num_layers=2, num_heads=2, block_size=4, head_dim=16, num_blocks=8)
    long = kvcore.CacheLayout(num_layers=3, num_heads=2, block_size=4, head_dim=16, num_blocks=8)
    writer, reader = (short, long) if stored == "shorter" else (long, short)
    old = open_h(layout=writer, namespace=namespace)
    new = open_h(layout=reader, namespace=namespace)
    seq = old.new_sequence(2)
    assert old.write(seq) == 2
    if buffers == "segmented":
        target, _ = new.segmented(2)
        got = new.backend.read(new.request(seq, host=target))
    else:
        got = new.read(seq)[0]
    assert (got, got.failure) == (0, None)
    assert new.backend.stats()["backend_foreign_removed"] >= 1
    assert new.write(seq) == 2, "the rewrite lands instead of being skipped"
    done, got = new.read(seq)
    assert done == 2 and blocks_equal(got, new.payload(seq, 0, 2)) == []
    new.backend.clear()


def test_remove_and_clear_of_a_backend_without_a_layout(open_h, mooncake_config) -> None:
    namespace = _fresh_namespace()
    h = open_h(namespace=namespace, layout=small_layout())
    seq = h.new_sequence(2)
    assert h.write(seq) == 2
    bare = kvcore.open_backend("mooncake", mooncake_config, context={"namespace": namespace})
    try:
        assert bare.remove(bare.request("rm", seq.keys[:1])) == 1
        assert h.query(seq) == 0
        assert bare.clear() == 2
    finally:
        bare.close()
