"""vLLM's tests of its tiering manager (``TieringOffloadingManager``), retargeted to kvcore
tiers: the two secondary tiers are ``KVCoreTier`` over ``memory`` and over kv_file where
vLLM's tests use two ``ExampleSecondaryTierManager``.

Source: vLLM ``tests/v1/kv_offload/tiering/test_tiering_offloading.py`` (the copy matching
0.32.0 cannot be fetched here; the stored copies name chunks "blocks", 0.32.0 names them
"chunks": ``num_chunks``/``chunk_ids`` below). vLLM's CPU engine refuses OffloadingConnector,
so the path is exercised as vLLM's tests exercise it: the manager with a CPU primary tier over
a mock mapped region (``MagicMock``, as upstream).

What changed, and why: the example tier answers lookups and finishes jobs at once; a kvcore
tier answers lookups asynchronously (RETRY until the background batch resolves, as vLLM's
``fs`` tier does) and finishes jobs on its own threads, so each test waits for them
(``_settle``) where the upstream test steps once. "Put the block in the tier by hand"
(``tier.blocks[k] = True``) is a real store through the tier. A partially failed promotion is a
real corrupt object: kvcore reports the leading run that was read (upstream's ``(0, 2)`` case,
a hole in the middle, cannot come from a prefix store). Not retargeted: tests that patch the
manager's own internals with mocks (``_register_job`` by hand, a mocked ``complete_write``,
``on_request_finished`` ordering against a mocked primary tier): they test vLLM, not the tier.
"""

from __future__ import annotations

import threading
import time
from unittest.mock import MagicMock

import pytest
import torch
from tier_helpers import CTX, damage, key, make_tier, offloading_spec
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

NUM_CHUNKS = 5
ROW_BYTES = 4096


def keys(ids) -> list[bytes]:
    return [key(i) for i in ids]


class Setup:
    """A CPU primary tier of 5 chunks and two kvcore tiers (memory, file) over its memory."""

    def __init__(self, root: str) -> None:
        self.tensor = torch.zeros((NUM_CHUNKS, ROW_BYTES), dtype=torch.int8)
        region = MagicMock()
        region.create_kv_memoryview.return_value = memoryview(self.tensor.numpy())
        self.primary = CPUPrimaryTierOffloadingManager(num_chunks=NUM_CHUNKS, mmap_region=region)
        # both tiers over the primary tier's memory (the tensor its mock region maps)
        self.tier1, _ = make_tier("memory", root, self.tensor, spec=offloading_spec())
        self.tier2, _ = make_tier("file", root, self.tensor, spec=offloading_spec())
        self.manager = TieringOffloadingManager(
            primary_tier=self.primary, secondary_tiers=[self.tier1, self.tier2]
        )

    def end_step(self, new_req_ids=()) -> None:
        self.manager.on_schedule_end(
            ScheduleEndContext(new_req_ids=list(new_req_ids), preempted_req_ids=())
        )
        list(self.manager.take_events())

    def settle(self) -> None:
        """Let the tiers' jobs finish, then end two steps: the manager polls finished jobs
        once a step, and not again in a step that already polled."""
        for tier in (self.tier1, self.tier2):
            tier.drain_jobs()
        self.end_step()
        self.end_step()

    def resolve(self, ks, ctx: ReqContext = CTX) -> None:
        """One step of lookups, so the asynchronous tiers' verdicts are in: the next lookups
        in one step then promote all of ``ks`` in one job, as a synchronous tier's would."""
        for k in ks:
            self.manager.lookup(k, ctx)
        self.end_step()
        for tier in (self.tier1, self.tier2):
            deadline = time.monotonic() + 10
            while tier._lookups._lookup_queue.qsize() and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(0.2)  # the batch in the worker's hands

    def start(self, ctx: ReqContext = CTX) -> None:
        if ctx.req_id not in self.manager._req_state:
            self.manager.on_new_request(ctx)

    def lookup_until_resolved(self, k, ctx: ReqContext = CTX, steps: int = 50) -> LookupResult:
        """A lookup repeated each step while it says RETRY (an asynchronous tier)."""
        for _ in range(steps):
            result = self.manager.lookup(k, ctx)
            if result is not LookupResult.RETRY:
                return result
            self.end_step()
            time.sleep(0.02)
        return result

    def store_in(self, tier, ids) -> None:
        """Store chunks in one tier through its own store path (vLLM's test writes
        ``tier.blocks[k] = True``)."""
        from tier_helpers import drain, make_job

        self.tensor[: len(ids)] = torch.randint(-100, 100, (len(ids), ROW_BYTES), dtype=torch.int8)
        tier.submit_store(make_job(900 + ids[0], keys(ids), list(range(len(ids)))))
        assert all(r.success for r in drain(tier))

    def close(self) -> None:
        self.manager.shutdown()


@pytest.fixture
def s(tmp_path):
    setup = Setup(str(tmp_path))
    yield setup
    setup.close()


def count_hits(manager, ks) -> int | None:
    n = 0
    for k in ks:
        result = manager.lookup(k, CTX)
        if result in (LookupResult.HIT_PENDING, LookupResult.RETRY):
            return None
        if result is not LookupResult.HIT:
            break
        n += 1
    return n


def test_basic_store_to_primary(s) -> None:
    blocks = keys(range(3))
    s.start()
    result = s.manager.prepare_store(blocks, CTX)
    assert result is not None and len(result.keys_to_store) == 3
    s.manager.complete_store(blocks, CTX, success=True)
    assert count_hits(s.primary, blocks) == 3


def test_cascade_to_all_secondary_tiers(s) -> None:
    blocks = keys(range(3))
    s.tier1.submit_store = MagicMock(wraps=s.tier1.submit_store)
    s.tier2.submit_store = MagicMock(wraps=s.tier2.submit_store)
    s.start()
    assert s.manager.prepare_store(blocks, CTX) is not None
    s.manager.complete_store(blocks, CTX, success=True)
    s.tier1.submit_store.assert_called_once()
    s.tier2.submit_store.assert_called_once()
    s.settle()
    from tier_helpers import lookup_and_wait

    assert lookup_and_wait(s.tier1, blocks) == [LookupResult.HIT] * 3
    assert lookup_and_wait(s.tier2, blocks) == [LookupResult.HIT] * 3


def test_ref_cnt_protection_during_cascade(s) -> None:
    blocks = keys(range(3))
    s.start()
    assert s.manager.prepare_store(blocks, CTX) is not None
    s.manager.complete_store(blocks, CTX, success=True)
    for k in blocks:  # one reference per secondary tier while its store runs
        assert s.primary._policy.get(k).ref_cnt == 2
    s.end_step()  # the step that submitted them has already polled: nothing released yet
    for k in blocks:
        assert s.primary._policy.get(k).ref_cnt == 2
    s.settle()  # the next step takes the finished stores: references released
    for k in blocks:
        assert s.primary._policy.get(k).ref_cnt == 0


def test_lookup_from_primary(s) -> None:
    blocks = keys(range(3))
    s.start()
    s.manager.prepare_store(blocks, CTX)
    s.manager.complete_store(blocks, CTX, success=True)
    assert count_hits(s.manager, blocks) == 3


def test_promotion_from_secondary(s) -> None:
    blocks = keys(range(3))
    s.store_in(s.tier1, [0, 1, 2])
    expected = s.tensor[:3].clone()
    s.tensor[:] = 0
    s.start()
    s.resolve(blocks)  # tier 1's asynchronous lookups find them
    for k in blocks:
        assert s.manager.lookup(k, CTX) is LookupResult.HIT_PENDING  # promotion initiated
    s.end_step()  # submits the promotions, one job
    s.settle()  # takes them
    assert count_hits(s.primary, blocks) == 3
    assert count_hits(s.manager, blocks) == 3
    spec = s.manager.prepare_load(blocks, CTX)
    for k, chunk in zip(blocks, spec.chunk_ids, strict=True):
        assert torch.equal(s.tensor[int(chunk)], expected[blocks.index(k)])


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (1, [LookupResult.HIT, LookupResult.MISS, LookupResult.MISS]),
        (0, [LookupResult.MISS, LookupResult.MISS, LookupResult.MISS]),
    ],
    ids=["partial", "full-failure"],
)
def test_failed_promotion_keeps_only_successful_blocks(s, bad, expected) -> None:
    blocks = keys(range(3))
    s.store_in(s.tier1, [0, 1, 2])
    damage(s.tier1, blocks[bad], "flip")  # kvcore's block digests catch it
    s.start()
    s.resolve(blocks)
    for k in blocks:
        assert s.manager.lookup(k, CTX) is LookupResult.HIT_PENDING
    s.end_step()  # one promotion job of the three chunks
    s.settle()
    assert [s.primary.lookup(k, CTX) for k in blocks] == expected


def test_eviction_in_primary_tier(s) -> None:
    blocks = keys(range(5))
    s.start()
    result = s.manager.prepare_store(blocks, CTX)
    assert result is not None and len(result.keys_to_store) == 5
    s.manager.complete_store(blocks, CTX, success=True)
    s.end_step()
    s.settle()  # cascades done: the primary tier's chunks are evictable again
    result = s.manager.prepare_store(keys(range(5, 7)), CTX)
    assert result is not None
    assert len(result.evicted_keys) == 2 and len(result.keys_to_store) == 2


def test_touch_propagates_to_all_tiers(s) -> None:
    blocks = keys(range(3))
    s.start()
    s.manager.prepare_store(blocks, CTX)
    s.manager.complete_store(blocks, CTX, success=True)
    s.end_step()
    s.settle()
    s.tier1.touch = MagicMock(wraps=s.tier1.touch)
    s.tier2.touch = MagicMock(wraps=s.tier2.touch)
    s.manager.touch(blocks, CTX)
    ranks = s.primary._policy._ranks  # 0.32's LRU order (the stored copy reads its deque)
    assert sorted(ranks, key=ranks.get)[-3:] == list(reversed(blocks))
    s.tier1.touch.assert_called_once_with(blocks, CTX)
    s.tier2.touch.assert_called_once_with(blocks, CTX)


def test_failed_store_no_cascade(s) -> None:
    blocks = keys(range(3))
    s.tier1.submit_store = MagicMock(wraps=s.tier1.submit_store)
    s.tier2.submit_store = MagicMock(wraps=s.tier2.submit_store)
    s.start()
    assert s.manager.prepare_store(blocks, CTX) is not None
    s.manager.complete_store(blocks, CTX, success=False)
    s.tier1.submit_store.assert_not_called()
    s.tier2.submit_store.assert_not_called()


def test_lookup_batches_submit_load_per_request(s) -> None:
    blocks = keys(range(4))
    s.store_in(s.tier1, [0, 1, 2, 3])
    s.tier1.submit_load = MagicMock(wraps=s.tier1.submit_load)
    ctx_a, ctx_b = ReqContext(req_id="req_a"), ReqContext(req_id="req_b")
    for ctx in (ctx_a, ctx_b):
        s.start(ctx)
    # first step: every lookup is asked (RETRY); the next ones find them and promote
    for k, ctx in zip(blocks, (ctx_a, ctx_a, ctx_b, ctx_b), strict=True):
        s.manager.lookup(k, ctx)
    s.end_step()
    time.sleep(0.3)
    s.tier1.submit_load.reset_mock()
    results = [
        s.manager.lookup(k, ctx)
        for k, ctx in zip(blocks, (ctx_a, ctx_a, ctx_b, ctx_b), strict=True)
    ]
    assert results == [LookupResult.HIT_PENDING] * 4
    s.tier1.submit_load.assert_not_called()  # only at the end of the step
    s.end_step()
    assert s.tier1.submit_load.call_count == 2
    jobs = [c.args[0] for c in s.tier1.submit_load.call_args_list]
    assert set(jobs[0].keys) == {blocks[0], blocks[1]} and jobs[0].req_context is ctx_a
    assert set(jobs[1].keys) == {blocks[2], blocks[3]} and jobs[1].req_context is ctx_b
    s.settle()


def test_lookup_shared_block_no_duplicate_promotion(s) -> None:
    shared = keys([0])[0]
    s.store_in(s.tier1, [0])
    s.tier1.submit_load = MagicMock(wraps=s.tier1.submit_load)
    ctx_a, ctx_b = ReqContext(req_id="req_a"), ReqContext(req_id="req_b")
    for ctx in (ctx_a, ctx_b):
        s.start(ctx)
    assert s.lookup_until_resolved(shared, ctx_a) is LookupResult.HIT_PENDING
    assert s.manager.lookup(shared, ctx_b) is LookupResult.HIT_PENDING
    s.end_step()
    s.tier1.submit_load.assert_called_once()
    job = s.tier1.submit_load.call_args.args[0]
    assert list(job.keys) == [shared] and job.req_context is ctx_a
    s.settle()


def test_complete_store_forwards_req_context_to_submit_store(s) -> None:
    blocks = keys(range(2))
    s.tier1.submit_store = MagicMock(wraps=s.tier1.submit_store)
    ctx = ReqContext(req_id="req_ctx", kv_transfer_params={"key": "value"})
    s.start(ctx)
    s.manager.prepare_store(blocks, ctx)
    s.manager.complete_store(blocks, ctx, success=True)
    assert s.tier1.submit_store.call_count == 1
    assert s.tier1.submit_store.call_args.args[0].req_context is ctx
    s.settle()


def test_reset_cache_drains_the_tiers_and_keeps_their_data(s) -> None:
    blocks = keys(range(3))
    s.start()
    s.manager.prepare_store(blocks, CTX)
    s.manager.complete_store(blocks, CTX, success=True)  # cascades in flight
    s.manager.reset_cache()  # waits for them (drain_jobs), then resets the primary tier
    from tier_helpers import lookup_and_wait

    assert count_hits(s.primary, blocks) == 0
    assert lookup_and_wait(s.tier2, blocks, ReqContext(req_id="after-reset")) == (
        [LookupResult.HIT] * 3
    )


def test_tier_counters_reach_the_manager_stats(s) -> None:
    blocks = keys(range(3))
    s.start()
    s.manager.prepare_store(blocks, CTX)
    s.manager.complete_store(blocks, CTX, success=True)
    s.settle()
    stats = s.manager.get_stats()
    assert stats is not None
    data = stats.data["data"]
    counted = data["vllm:kv_offload_tiering_kvcore_host_blocks"][("kvcore", "write")]
    assert counted == 6  # 3 chunks, 2 kvcore tiers
    assert TieringOffloadingMetrics.WRITE_BYTES in data  # vLLM's own tier metrics too
    again = s.manager.get_stats()
    assert again is None or "vllm:kv_offload_tiering_kvcore_host_blocks" not in again.data["data"]


def test_spec_collects_the_tiers_metric_definitions() -> None:
    metrics = TieringOffloadingSpec.build_metric_definitions(
        {"secondary_tiers": [{"type": "kvcore", "backend": "memory"}]}
    )
    for name in ("host_blocks", "host_blocks_failed", "host_blocks_done", "host_blocks_refused"):
        assert metrics[f"vllm:kv_offload_tiering_kvcore_{name}"].labelnames == ("tier", "op")
    for name in ("events_unmapped", "backend_failures"):
        assert metrics[f"vllm:kv_offload_tiering_kvcore_{name}"].labelnames == ("tier",)


def test_shutdown_leaves_no_tier_thread(tmp_path) -> None:
    setup = Setup(str(tmp_path))
    setup.start()
    setup.manager.prepare_store(keys(range(3)), CTX)
    setup.manager.complete_store(keys(range(3)), CTX, success=True)
    setup.close()
    alive = [t.name for t in threading.enumerate() if t.name.startswith(("kvcore", "kv_file"))]
    assert alive == []
