"""vLLM's own tests of its ``fs`` secondary tier, retargeted to the kvcore tier.

Source: vLLM ``tests/v1/kv_offload/tiering/test_fs_tier.py``. The copy matching the installed
release (0.32.0) cannot be fetched here; these follow the newest stored copy (commit 000f561),
whose API matches 0.32.0's (``TransferJob``/``chunk_ids``, ``enable_kv_events``,
``locality``), leaving out what 0.32.0's fs tier does not have (xattr checksums).

What changed, test by test, and only this: the tier is ``KVCoreTier`` over kv_file (a
temporary root) and over ``memory``; "the block's file exists" is "the store holds the chunk"
(a ``query``); a corrupt block is a truncated kv_file object or, in ``memory``, a flipped
byte (caught by kvcore's block digests); a failing store is a flaky store call instead of
vLLM's ``batch_store_block``. Tests of the fs tier's own internals have no kvcore
counterpart and are not here: its thread pool (``DualQueueThreadPool``, ``wait_idle``), its C
lookup extension (``batch_lookup_C``, ``use_c_ext``), CRC32C xattr checksums (kvcore checksums
are tested below and in ``test_tier.py``). One upstream test asserts the opposite of kv_file's
policy: ``test_transient_load_failure_leaves_file`` wants a symlink loop at a block's path left
alone; kv_file removes anything at an object's place that is not a regular file (its README).
``test_partially_failed_store_emits_no_event``: upstream emits nothing for a store job with a
failed block; kvcore reports what the store holds, so the chunk stored before the failure is
reported (asserted below), and nothing for the failed one.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from kvcore_vllm.tier import KVCoreTier
from tier_helpers import (
    BACKENDS,
    CTX,
    NUM_CHUNKS,
    aligned_tensor,
    backend_settings,
    damage,
    drain,
    key,
    lookup_and_wait,
    make_job,
    make_tier,
    object_names,
    offloading_spec,
    stored,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvcore import Outcome


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def tier_and_tensor(backend, tmp_path):
    tier, tensor = make_tier(backend, str(tmp_path))
    yield tier, tensor
    tier.shutdown()


@pytest.fixture
def tier_with_events(backend, tmp_path):
    tier, _ = make_tier(
        backend,
        str(tmp_path),
        spec=offloading_spec(enable_kv_cache_events=True),
        enable_kv_events=True,
        locality="LOCAL",
    )
    yield tier
    tier.shutdown()


def test_lookup_empty_tier(tier_and_tensor) -> None:
    tier, _ = tier_and_tensor
    assert lookup_and_wait(tier, [key(1), key(2)]) == [LookupResult.MISS] * 2


def test_store_creates_object_and_lookup_succeeds(tier_and_tensor) -> None:
    tier, _ = tier_and_tensor
    tier.submit_store(make_job(1, [key(1)], [0]))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    assert lookup_and_wait(tier, [key(1)]) == [LookupResult.HIT]
    assert stored(tier, key(1))


def test_store_then_load_roundtrip(tier_and_tensor) -> None:
    tier, _ = tier_and_tensor
    tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
    assert all(r.success for r in drain(tier))
    assert lookup_and_wait(tier, [key(1), key(2)]) == [LookupResult.HIT] * 2
    tier.submit_load(make_job(2, [key(1), key(2)], [2, 3], promotion=True))
    assert all(r.success for r in drain(tier))
    assert stored(tier, key(1)) and stored(tier, key(2))  # a good load leaves them stored
    assert lookup_and_wait(tier, [key(1), key(2)]) == [LookupResult.HIT] * 2


def test_invalid_path_raises_at_construction(backend) -> None:
    if backend != "file":
        pytest.skip("the memory store has no path")
    with pytest.raises(Exception, match="root"):  # kv_file: one line naming the setting
        make_tier(backend, "/dev/null/invalid_path")


@pytest.mark.parametrize("locality", ["local", ""])
def test_invalid_locality_raises_at_construction(backend, tmp_path, locality) -> None:
    with pytest.raises(ValueError, match="Locality"):
        make_tier(backend, str(tmp_path), locality=locality)


def test_factory_forwards_locality_to_the_tier(backend, tmp_path) -> None:
    tensor = aligned_tensor(4)
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "kvcore", **backend_settings(backend, str(tmp_path)), "locality": "LOCAL"},
        memoryview(tensor.numpy()),
        offloading_spec(),
    )
    try:
        assert isinstance(tier, KVCoreTier)
        assert tier.locality is Locality.LOCAL
    finally:
        tier.shutdown()


def test_failed_load_missing_object(tier_and_tensor) -> None:
    tier, _ = tier_and_tensor
    tier.submit_load(make_job(1, [key(99)], [0], promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success


def test_multiple_jobs_tracked_independently(tier_and_tensor) -> None:
    tier, _ = tier_and_tensor
    tier.submit_store(make_job(1, [key(1)], [0]))
    tier.submit_store(make_job(2, [key(2)], [1]))
    assert {r.job_id for r in drain(tier)} == {1, 2}
    assert lookup_and_wait(tier, [key(1), key(2)]) == [LookupResult.HIT] * 2


def test_multi_block_job_partial_failure(tier_and_tensor) -> None:
    tier, _ = tier_and_tensor
    tier.submit_store(make_job(1, [key(10), key(11)], [0, 1]))
    assert all(r.success for r in drain(tier))
    tier.submit_load(make_job(2, [key(10), key(11), key(99)], [0, 1, 2], promotion=True))
    results = drain(tier)
    assert len(results) == 1 and results[0].job_id == 2 and not results[0].success


def test_shutdown_discards_pending_tasks(tier_and_tensor) -> None:
    tier, _ = tier_and_tensor
    for i in range(10):
        tier.submit_store(make_job(i, [key(i)], [i % 4]))
    tier.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvcore-tier")]


@pytest.mark.parametrize("batch_size", [0, 1, 2, 5])
def test_store_load_data_integrity(tier_and_tensor, batch_size) -> None:
    tier, tensor = tier_and_tensor
    tensor[:] = torch.rand(NUM_CHUNKS, tensor.shape[1])
    keys = [key(i) for i in range(batch_size)]
    load_ids = list(range(NUM_CHUNKS - batch_size, NUM_CHUNKS))
    expected = tensor[:batch_size].clone()
    tier.submit_store(make_job(1, keys, list(range(batch_size))))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    assert all(stored(tier, k) for k in keys)
    tensor[:] = 0.0  # the data must come from the store
    tier.submit_load(make_job(2, keys, load_ids, promotion=True))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    for i, cid in enumerate(load_ids):
        assert torch.equal(tensor[cid], expected[i]), f"chunk {cid} differs after store+load"


def test_store_load_roundtrip_without_direct_reads(tmp_path) -> None:
    """vLLM's fs tier falls back to buffered I/O without O_DIRECT; kv_file reads buffered
    with ``direct_reads`` off."""
    tensor = aligned_tensor(4, random=True)
    tier, _ = make_tier(
        "file",
        str(tmp_path),
        tensor,
        backend_config={"root": str(tmp_path), "direct_reads": False},
    )
    try:
        expected = tensor[:2].clone()
        tier.submit_store(make_job(1, [key(0), key(1)], [0, 1]))
        assert all(r.success for r in drain(tier))
        tensor[:2] = 0.0
        tier.submit_load(make_job(2, [key(0), key(1)], [2, 3], promotion=True))
        assert all(r.success for r in drain(tier))
        for i, cid in enumerate([2, 3]):
            assert torch.equal(tensor[cid], expected[i])
    finally:
        tier.shutdown()


def test_batch_lookup_dispatch(tier_and_tensor) -> None:
    tier, _ = tier_and_tensor
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert all(r.success for r in drain(tier))
    assert lookup_and_wait(tier, [key(1), key(2)]) == [LookupResult.HIT, LookupResult.MISS]


def test_out_of_bounds_chunk_id_smoke(tier_and_tensor) -> None:
    tier, tensor = tier_and_tensor
    beyond = tensor.shape[0]
    tier.submit_store(make_job(1, [key(1)], [beyond]))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    tier.submit_load(make_job(2, [key(1)], [beyond], promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success


def test_failed_load_corrects_verdict_and_removes_corrupt_object(tier_and_tensor) -> None:
    """vLLM's failed-load livelock regression: a promotion that reads a corrupt block fails,
    the object is removed, and the same request's next lookup is a cached MISS (no
    re-probe); a fresh request re-probes and misses too."""
    tier, _ = tier_and_tensor
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert all(r.success for r in drain(tier))
    ctx = ReqContext(req_id="livelock-req")
    assert lookup_and_wait(tier, [key(1)], ctx=ctx) == [LookupResult.HIT]
    tier.submit_load(make_job(2, [key(1)], [0], promotion=True))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    assert tier.lookup(key(1), ctx) is LookupResult.HIT
    assert stored(tier, key(1))

    damage(tier, key(1), "truncate" if tier.backend.name == "file" else "flip")
    tier.submit_load(make_job(3, [key(1)], [0], promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    assert not stored(tier, key(1)), "the corrupt object must be removed"
    assert tier.lookup(key(1), ctx) is LookupResult.MISS
    assert tier._lookups._lookup_batch == []
    fresh = ReqContext(req_id="fresh-after-short-read")
    assert lookup_and_wait(tier, [key(1)], ctx=fresh) == [LookupResult.MISS]


def test_batched_partial_load_failure_keeps_loaded_blocks(tier_and_tensor) -> None:
    tier, _ = tier_and_tensor
    keys = [key(1), key(2), key(3)]
    tier.submit_store(make_job(1, keys, [0, 1, 2]))
    assert all(r.success for r in drain(tier))
    ctx = ReqContext(req_id="batch-req")
    assert lookup_and_wait(tier, keys, ctx=ctx) == [LookupResult.HIT] * 3
    damage(tier, key(3), "truncate" if tier.backend.name == "file" else "flip")
    tier.submit_load(make_job(2, keys, [0, 1, 2], promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    assert tuple(results[0].successful_keys) == (key(1), key(2))
    assert [tier.lookup(k, ctx) for k in keys] == [
        LookupResult.HIT,
        LookupResult.HIT,
        LookupResult.MISS,
    ]
    assert tier._lookups._lookup_batch == []
    tier.on_request_finished(ctx)
    fresh = ReqContext(req_id="fresh-batch-req")
    assert lookup_and_wait(tier, keys, ctx=fresh) == [
        LookupResult.HIT,
        LookupResult.HIT,
        LookupResult.MISS,
    ]


def test_batched_load_first_block_fails_marks_whole_batch(tier_and_tensor) -> None:
    tier, _ = tier_and_tensor
    keys = [key(1), key(2), key(3)]
    tier.submit_store(make_job(1, keys, [0, 1, 2]))
    assert all(r.success for r in drain(tier))
    ctx = ReqContext(req_id="batch-first-fail")
    assert lookup_and_wait(tier, keys, ctx=ctx) == [LookupResult.HIT] * 3
    damage(tier, key(1), "truncate" if tier.backend.name == "file" else "flip")
    tier.submit_load(make_job(2, keys, [0, 1, 2], promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    assert results[0].successful_keys is None
    assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3


# -- KV events --------------------------------------------------------------------------------


def test_successful_store_emits_stored_event(tier_with_events) -> None:
    tier = tier_with_events
    keys = [key(1), key(2)]
    tier.submit_store(make_job(1, keys, [0, 1]))
    assert all(r.success for r in drain(tier))
    events = list(tier.take_events())
    assert len(events) == 1
    assert events[0].keys == keys
    assert events[0].medium == Medium.STORAGE
    assert events[0].locality is Locality.LOCAL
    assert not events[0].removed
    assert list(tier.take_events()) == []


@pytest.mark.parametrize(("locality", "expected"), [(None, None), ("REMOTE", Locality.REMOTE)])
def test_store_event_uses_configured_locality(backend, tmp_path, locality, expected) -> None:
    extra = {} if locality is None else {"locality": locality}
    tier, _ = make_tier(
        backend,
        str(tmp_path),
        aligned_tensor(4),
        spec=offloading_spec(enable_kv_cache_events=True),
        enable_kv_events=True,
        **extra,
    )
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert all(r.success for r in drain(tier))
        events = list(tier.take_events())
        assert len(events) == 1 and events[0].locality is expected
    finally:
        tier.shutdown()


def test_load_job_emits_no_event(tier_with_events) -> None:
    tier = tier_with_events
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert [r.success for r in drain(tier)] == [True]
    list(tier.take_events())
    tier.submit_load(make_job(2, [key(1)], [1], promotion=True))
    assert [r.success for r in drain(tier)] == [True]
    assert list(tier.take_events()) == []


def _flaky_store(tier: KVCoreTier, failing: bytes) -> None:
    """Make every store call that names chunk ``failing`` fail there (as vLLM's test makes its
    ``batch_store_block`` fail for one path); the chunks before it in the call are stored."""
    bad = object_names(tier, failing)[0]
    store = tier.store

    def write(request, admit=False):
        names = [n for row in request.object_names for n in row]
        if bad not in names:
            return store.write(request, admit=admit)
        done = names.index(bad) // len(request.parts)
        if done:
            store.write(request.slice(0, done, host=request.host.slice(0, done)))
        return Outcome(done, "injected store failure")

    tier.store = _Wrapped(store, write)


class _Wrapped:
    """A store whose ``write`` is replaced (everything else is the store's own)."""

    def __init__(self, store, write) -> None:
        self._store, self.write = store, write

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_mixed_job_results_emit_event_only_for_successful_job(tier_with_events) -> None:
    tier = tier_with_events
    _flaky_store(tier, key(1))
    tier.submit_store(make_job(1, [key(1)], [0]))
    tier.submit_store(make_job(2, [key(2)], [1]))
    by_id = {r.job_id: r for r in drain(tier)}
    assert not by_id[1].success and by_id[2].success
    events = list(tier.take_events())
    assert len(events) == 1 and events[0].keys == [key(2)]


def test_partially_failed_store_reports_what_was_stored(tier_with_events) -> None:
    tier = tier_with_events
    _flaky_store(tier, key(2))
    tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    events = list(tier.take_events())
    assert [e.keys for e in events] == [[key(1)]]  # the store holds key 1, not key 2


def test_events_disabled_by_default(tier_and_tensor) -> None:
    tier, _ = tier_and_tensor
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert [r.success for r in drain(tier)] == [True]
    assert tier._events is None and tier._subscription is None
    assert list(tier.take_events()) == []


def test_events_require_global_kv_events_flag(backend, tmp_path) -> None:
    tier, _ = make_tier(
        backend,
        str(tmp_path),
        aligned_tensor(4),
        spec=offloading_spec(enable_kv_cache_events=False),
        enable_kv_events=True,
    )
    try:
        assert tier._events is None
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in drain(tier)] == [True]
        assert list(tier.take_events()) == []
    finally:
        tier.shutdown()


def test_cascade_store_emits_event_through_tiering_manager(backend, tmp_path) -> None:
    from unittest.mock import MagicMock

    from vllm.v1.kv_offload.tiering.manager import (
        CPUPrimaryTierOffloadingManager,
        TieringOffloadingManager,
    )

    tensor = aligned_tensor(4)
    region = MagicMock()
    region.create_kv_memoryview.return_value = memoryview(tensor.numpy())
    primary = CPUPrimaryTierOffloadingManager(num_chunks=4, mmap_region=region)
    tier, _ = make_tier(
        backend,
        str(tmp_path),
        tensor,
        spec=offloading_spec(enable_kv_cache_events=True),
        enable_kv_events=True,
    )
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])
    try:
        keys = [key(1), key(2)]
        manager.on_new_request(CTX)
        assert manager.prepare_store(keys, CTX) is not None
        manager.complete_store(keys, CTX)  # cascades to the kvcore tier
        events: list[OffloadingEvent] = []
        end = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not events:
            manager.on_schedule_end(end)
            events.extend(e for e in manager.take_events() if e.medium == Medium.STORAGE)
            time.sleep(0.01)
        assert len(events) == 1
        assert set(events[0].keys) == set(keys) and not events[0].removed
    finally:
        tier.shutdown()


def test_cross_tp_round_trip(tmp_path) -> None:
    """A TP=2 replicated-layout writer and a TP=4 reader share keys and bytes."""
    writer_tensor = aligned_tensor(4, random=True)
    expected = writer_tensor[0].clone()
    writer, _ = make_tier(
        "file",
        str(tmp_path),
        writer_tensor,
        spec=offloading_spec(tp_size=2, rank=0, replicated_layout=True),
    )
    try:
        writer.submit_store(make_job(1, [key(7)], [0]))
        assert all(r.success for r in drain(writer))
    finally:
        writer.shutdown()
    reader_tensor = aligned_tensor(4)
    reader, _ = make_tier(
        "file",
        str(tmp_path),
        reader_tensor,
        spec=offloading_spec(tp_size=4, rank=3, replicated_layout=True),
    )
    try:
        assert reader.keys.prefix == writer.keys.prefix
        assert lookup_and_wait(reader, [key(7)]) == [LookupResult.HIT]
        reader.submit_load(make_job(2, [key(7)], [1], promotion=True))
        assert all(r.success for r in drain(reader))
        assert torch.equal(reader_tensor[1], expected)
    finally:
        reader.shutdown()
