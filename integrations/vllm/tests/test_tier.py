"""The kvcore secondary tier beyond vLLM's own tier tests: a corrupted chunk is never promoted
(recomputed, stored again), settings fail at start-up naming the key, keys are scoped and the
same in every process, failures are counted misses, backpressure drops stores, events follow
evictions and other processes, and shutdown leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
import torch
from kvcore_vllm.config import SettingsError
from kvcore_vllm.tier import PART, KVCoreTier
from tier_helpers import (
    CTX,
    aligned_tensor,
    backend_settings,
    damage,
    drain,
    engine_config,
    key,
    lookup_and_wait,
    make_job,
    make_tier,
    object_names,
    offloading_spec,
    stored,
)
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

import kvcore
from kvcore.keys import ObjectName

ROW = 64 << 10


def _metric(stats, name: str, op: str | None = None) -> float:
    """A tier counter's total in one ``get_stats`` (of jobs of ``op`` only, when given)."""
    data = stats.data["data"] if stats is not None else {}
    values = data.get(f"vllm:kv_offload_tiering_kvcore_{name}", {})
    return sum(v for labels, v in values.items() if op is None or labels[-1] == op)


@pytest.mark.parametrize("caught_at", ["promotion", "lookup"])
@pytest.mark.parametrize("backend", ["file", "memory", "mooncake"])
def test_a_flipped_bit_is_never_promoted_and_the_chunk_is_stored_again(
    backend, caught_at, tmp_path, request
) -> None:
    """A corrupt chunk is caught by the promotion's read (``load_policy: always``: the lookup
    reads nothing), or already by the lookup (``auto`` with a prefill rate to weigh it against:
    a store never read by this process is probed first, and the probe's verified read finds
    it): never promoted either way, removed,
    counted, and stored again once recomputed."""
    # vLLM's own primary-tier memory, as its scheduler maps it (a /dev/shm region, no rank)
    region = SharedOffloadRegion(
        engine_id=f"kvcore-test-{uuid.uuid4().hex}",
        num_chunks=4,
        rank=None,
        kv_bytes_per_chunk=ROW,
        cpu_page_size=ROW,
    )
    primary = CPUPrimaryTierOffloadingManager(num_chunks=4, mmap_region=region)
    tensor = torch.from_numpy(np.asarray(primary.get_kv_memoryview()))  # the region's bytes
    more = {}
    if backend == "mooncake":  # a real master and storage node on 127.0.0.1
        more["backend_config"] = request.getfixturevalue("mooncake_config")
    if caught_at == "promotion":
        more["load_policy"] = "always"
    else:  # computing is slow: the decision weighs the store, so it probes it first
        more["prefill_tokens_per_s"] = 1000.0
    spec = offloading_spec()
    # vLLM's 16-token blocks (the mocked spec's default says 1: a one-token chunk never saves
    # its prompt's last token, which is computed whatever is loaded, so it is not worth loading)
    spec.tokens_per_block = (16,)
    tier, _ = make_tier(backend, str(tmp_path), tensor, spec=spec, **more)
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])
    end = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())

    def steps(n: int = 2) -> None:
        for _ in range(n):
            tier.drain_jobs()
            manager.on_schedule_end(end)
            time.sleep(0.05)

    def lookup(ctx: ReqContext) -> LookupResult:
        for _ in range(100):  # an asynchronous tier: RETRY until its verdict is in
            result = manager.lookup(key(1), ctx)
            if result is not LookupResult.RETRY:
                return result
            steps(1)
        return result

    chunk = torch.randint(-128, 127, (ROW,), dtype=torch.int8)
    try:
        # stored once: computed into the primary tier and cascaded to the kvcore tier
        first = ReqContext(req_id="first")
        manager.on_new_request(first)
        spec = manager.prepare_store([key(1)], first)
        tensor[int(spec.store_spec.chunk_ids[0])] = chunk
        manager.complete_store([key(1)], first)
        steps()
        manager.on_request_finished(first)
        assert stored(tier, key(1))
        manager.reset_cache()  # the primary tier forgets it: only the kvcore tier has it
        tensor.zero_()

        damage(tier, key(1), "flip")
        second = ReqContext(req_id="second")
        manager.on_new_request(second)
        if caught_at == "promotion":
            assert lookup(second) is LookupResult.HIT_PENDING  # found, promotion started
            steps()
        assert primary.lookup(key(1), second) is LookupResult.MISS, "corrupt bytes promoted"
        assert lookup(second) is LookupResult.MISS  # this request recomputes
        stats = manager.get_stats()
        assert _metric(stats, "host_blocks_failed", "read") == (caught_at == "promotion")
        assert _metric(stats, "backend_failures") >= 1
        assert not stored(tier, key(1)), "the corrupt object must be removed"

        # recomputed: stored in the primary tier again and cascaded, the object heals
        spec = manager.prepare_store([key(1)], second)
        tensor[int(spec.store_spec.chunk_ids[0])] = chunk
        manager.complete_store([key(1)], second)
        steps()
        manager.on_request_finished(second)
        assert stored(tier, key(1))
        manager.reset_cache()
        tensor.zero_()
        third = ReqContext(req_id="third")
        manager.on_new_request(third)
        assert lookup(third) is LookupResult.HIT_PENDING
        steps()
        assert manager.lookup(key(1), third) is LookupResult.HIT
        load = manager.prepare_load([key(1)], third)
        assert torch.equal(tensor[int(load.chunk_ids[0])], chunk), "the healed chunk differs"
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"backend": "file", "root_dir": "/x"}, "root_dir: Extra inputs are not permitted"),
        ({"backend": "file", "backend_config": {"capacity": 1}}, "capacity"),
        ({"backend": "file", "store_timeout_s": float("inf")}, "store_timeout_s"),
        ({"backend": "file", "load_workers": 0}, "load_workers"),
        ({"backend": "nope"}, "no kvcore backend named 'nope'"),
        ({}, "backend: Field required"),
    ],
)
def test_bad_settings_fail_at_start_up_naming_the_key(tmp_path, settings, named) -> None:
    if settings.get("backend") == "file":
        settings.setdefault("backend_config", {}).setdefault("root", str(tmp_path))
    tensor = aligned_tensor(2)
    with pytest.raises(Exception, match=named) as info:
        SecondaryTierFactory.create_secondary_tier(
            {"type": "kvcore", **settings}, memoryview(tensor.numpy()), offloading_spec()
        )
    assert isinstance(info.value, (SettingsError, ValueError, LookupError))


def test_the_module_path_form_selects_the_tier(tmp_path) -> None:
    tensor = aligned_tensor(2)
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KVCoreTier", "module_path": "kvcore_vllm.tier", "backend": "memory"},
        memoryview(tensor.numpy()),
        offloading_spec(),
    )
    assert isinstance(tier, KVCoreTier)
    tier.shutdown()


def test_keys_are_scoped_and_the_same_in_every_process(tmp_path, model_dir) -> None:
    """Built where the engine's config is visible (as in an engine), a chunk's name depends on
    the model, the TP layout, the weights and the model's settings, and is the same in every
    process whatever PYTHONHASHSEED."""
    with engine_config(model_dir):
        a, _ = make_tier("memory", "", spec=offloading_spec(model="model-a"))
        b, _ = make_tier("memory", "", spec=offloading_spec(model="model-b"))
        tp2, _ = make_tier("memory", "", spec=offloading_spec(tp_size=2))
        wv, _ = make_tier("memory", "", weight_version="7")
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}
    with engine_config(model_dir, hf_overrides=rope):
        other_rope, _ = make_tier("memory", "", spec=offloading_spec(model="model-a"))
    tiers = (a, b, tp2, wv, other_rope)
    try:
        names = {t: object_names(t, key(5))[0] for t in tiers}
        assert len(set(names.values())) == 5, names  # model, TP, weights, RoPE: all apart
        assert a.keys.offload_key(ObjectName.parse(names[a])) == key(5)
        # another scope: never this tier's chunk
        assert a.keys.offload_key(ObjectName.parse(names[b])) is None
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); from tier_helpers import *\n"
            "with engine_config(sys.argv[2]):\n"
            "    t, _ = make_tier('memory', '', spec=offloading_spec(model='model-a'))\n"
            "print(object_names(t, key(5))[0]); t.shutdown()"
        )
        for seed in ("0", "12345"):
            out = subprocess.run(
                [sys.executable, "-c", code, os.path.dirname(__file__), str(model_dir)],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONHASHSEED": seed},
                timeout=120,
            )
            assert out.stdout.strip().splitlines()[-1] == names[a], out.stderr[-2000:]
    finally:
        for t in tiers:
            t.shutdown()


class _FailingStore:
    """A store whose calls raise (a backend that broke)."""

    def __init__(self, store) -> None:
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)

    def query(self, request):
        raise ConnectionError("backend unreachable")

    def contains(self, request):
        raise ConnectionError("backend unreachable")

    def read(self, request):
        raise ConnectionError("backend unreachable")


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_a_lookup_batch_asks_the_backend_once_however_many_gaps(backend, tmp_path, request) -> None:
    """vLLM's lookups of one request and step reach the tier as one batch: the tier answers
    it with one ``contains`` call (kv_file: one index pass; Mooncake: one ``batch_is_exist``)
    where a leading-run query per gap cost a round trip per miss."""
    more = {}
    if backend == "mooncake":
        more["backend_config"] = request.getfixturevalue("mooncake_config")
    tier, _ = make_tier(backend, str(tmp_path), **more)
    try:
        present = [1, 3, 5, 7]  # stored; 2, 4, 6, 8 are gaps
        tier.submit_store(make_job(1, [key(i) for i in present], [0, 1, 2, 3]))
        assert all(r.success for r in drain(tier))
        backend_stats = tier.store.metrics.snapshot
        before = backend_stats()
        got = lookup_and_wait(tier, [key(i) for i in range(1, 9)])
        after = backend_stats()
        want = [LookupResult.HIT if i in present else LookupResult.MISS for i in range(1, 9)]
        assert got == want
        calls = {op: after.get(f"calls.{op}", 0) - before.get(f"calls.{op}", 0)
                 for op in ("contains", "query")}  # fmt: skip
        assert calls == {"contains": 1, "query": 0}
    finally:
        tier.shutdown()


def test_backend_failures_are_misses_never_raised(tmp_path) -> None:
    tier, _ = make_tier("memory", "")
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in drain(tier)] == [True]
        tier.store = _FailingStore(tier.store)
        assert lookup_and_wait(tier, [key(1)]) == [LookupResult.MISS]
        tier.submit_load(make_job(2, [key(1)], [1], promotion=True))
        results = drain(tier)
        assert len(results) == 1 and not results[0].success
        stats = tier.get_stats()
        assert (
            _metric(stats, "host_failures", "read") == 1
            and _metric(stats, "host_blocks_failed", "read") == 1
        )
    finally:
        tier.shutdown()


def test_a_store_not_up_at_start_is_a_miss_until_it_opens() -> None:
    """A Mooncake master that is not up yet when vLLM builds its tiers: the engine starts,
    lookups miss, jobs fail (vLLM recomputes), and once the master is up the tier opens on the
    next try and stores and loads chunks (kvcore's handle: the connector's policy)."""
    from kv_mooncake.testing import MooncakeCluster, free_port

    cluster = MooncakeCluster(storage_bytes=64 << 20)
    cluster.master.rpc_port, cluster.master.metrics_port = free_port(), free_port()
    config = cluster.config(connect_timeout_s=1.0)  # where no master listens yet
    tier, tensor = make_tier("mooncake", "", aligned_tensor(random=True),
                             backend_config=config, reopen_interval_s=0.5)  # fmt: skip
    try:
        assert tier.backend is None
        assert lookup_and_wait(tier, [key(1)]) == [LookupResult.MISS]
        tier.submit_store(make_job(1, [key(1)], [0]))
        tier.submit_load(make_job(2, [key(1)], [1], promotion=True))
        assert [r.success for r in drain(tier)] == [False, False]
        stats = tier.get_stats()
        assert (
            _metric(stats, "host_failures", "lookup") == 1
            and _metric(stats, "host_blocks_failed", "read") == 1
        )
        assert _metric(stats, "host_blocks_failed", "write") == 1

        cluster.start()
        time.sleep(0.6)  # past reopen_interval_s: the next call opens it
        tier.submit_store(make_job(3, [key(1)], [0]))
        assert [r.success for r in drain(tier)] == [True]
        assert tier._handle.open_failures >= 1
        tier.on_request_finished(CTX)  # vLLM keeps a request's lookup verdicts until it ends
        assert lookup_and_wait(tier, [key(1)]) == [LookupResult.HIT]
        tier.submit_load(make_job(4, [key(1)], [1], promotion=True))
        assert [r.success for r in drain(tier)] == [True]
        assert torch.equal(tensor[1], tensor[0])
    finally:
        tier.shutdown()
        cluster.close()


def test_a_full_store_queue_drops_stores_and_counts_them(tmp_path) -> None:
    tier, _ = make_tier("memory", "", store_workers=1, max_queued_stores=1)
    gate = threading.Event()

    class GatedWrites:
        """The tier's store, whose writes wait for ``gate``."""

        def __init__(self, store) -> None:
            self._store = store

        def write(self, request, **how):
            gate.wait(30)
            return self._store.write(request, **how)

        def __getattr__(self, name: str):
            return getattr(self._store, name)

    tier.store = GatedWrites(tier.store)
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))  # runs, blocked
        time.sleep(0.2)
        tier.submit_store(make_job(2, [key(2)], [1]))  # queued
        tier.submit_store(make_job(3, [key(3)], [2]))  # the queue is full: dropped at once
        dropped = list(tier.get_finished_jobs())
        assert [(r.job_id, r.success) for r in dropped] == [(3, False)]
        gate.set()
        assert sorted((r.job_id, r.success) for r in drain(tier)) == [(1, True), (2, True)]
        assert _metric(tier.get_stats(), "host_dropped", "write") == 1
    finally:
        gate.set()
        tier.shutdown()


def test_chunks_the_store_does_not_admit_are_refused_not_failed(tmp_path) -> None:
    # kv_file with second-hit admission: a chunk is written the second time it is offered
    tier, _ = make_tier(
        "file", "", backend_config={"root": str(tmp_path), "admission": "second-hit"}
    )
    try:
        tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
        assert [r.success for r in drain(tier)] == [True]  # refused: not a failure
        assert lookup_and_wait(tier, [key(1), key(2)]) == [LookupResult.MISS] * 2
        tier.on_request_finished(CTX)  # vLLM keeps a key's lookup until its requests finish
        tier.submit_store(make_job(2, [key(1), key(2)], [0, 1]))
        assert [(r.success, r.transfer_bytes) for r in drain(tier)] == [
            (True, 2 * tier._chunk_bytes)
        ]
        assert lookup_and_wait(tier, [key(1), key(2)]) == [LookupResult.HIT] * 2
        stats = tier.get_stats()
        assert _metric(stats, "host_blocks_refused", "write") == 2
        assert _metric(stats, "host_blocks_failed", "write") == 0
        assert tier.backend.stats()["backend_admission_refused"] == 2
    finally:
        tier.shutdown()


def test_events_report_evictions_and_other_processes_stores(tmp_path) -> None:
    """kv_file reports what it evicts and what other openers store: both reach vLLM as the
    tier's events (BlockStored / BlockRemoved once vLLM translates them)."""
    spec = offloading_spec(enable_kv_cache_events=True)
    row_bytes = aligned_tensor(1).numel() * 4
    capacity = 6 * (row_bytes + 4096)  # six chunks with their headers
    config = {"root": str(tmp_path), "capacity_bytes": capacity, "rescan_interval_s": 0}
    tier, _ = make_tier("file", "", spec=spec, enable_kv_events=True, backend_config=config)
    other, _ = make_tier("file", "", spec=spec, backend_config=config)
    try:
        other.submit_store(make_job(1, [key(100)], [0]))  # another opener of the store
        assert [r.success for r in drain(other)] == [True]
        for i in range(8):  # more than the capacity: the oldest chunks are evicted
            tier.submit_store(make_job(10 + i, [key(i)], [i]))
            assert [r.success for r in drain(tier)] == [True]
        time.sleep(0.2)
        events = list(tier.take_events())
        stored_keys = [k for e in events if not e.removed for k in e.keys]
        removed_keys = [k for e in events if e.removed for k in e.keys]
        assert key(100) in stored_keys and stored_keys.count(key(0)) == 1
        assert removed_keys and key(100) in removed_keys  # the oldest: the other's chunk
        present = {k for k in [key(100), *map(key, range(8))] if stored(tier, k)}
        told = set(stored_keys) - set(removed_keys)
        assert told == present
    finally:
        tier.shutdown()
        other.shutdown()


@pytest.mark.parametrize("backend", ["file", "memory"])
def test_chunks_move_from_and_into_the_primary_tiers_own_memory(
    backend, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No staging copy: the region is registered with the backend once, and every store and
    load hands the backend the primary tier's own chunk addresses. (The backend's calls are
    recorded by delegating wrappers: every call still runs on the real backend.)"""
    registered: list[tuple[int, int]] = []
    real_register = kvcore.Backend.register_buffer

    def record_register(self: kvcore.Backend, ptr: int, nbytes: int) -> None:
        registered.append((ptr, nbytes))
        real_register(self, ptr, nbytes)

    monkeypatch.setattr(kvcore.Backend, "register_buffer", record_register)
    tensor = aligned_tensor(random=True)
    tier, _ = make_tier(backend, str(tmp_path), tensor)
    chunk_bytes = tensor.shape[1] * tensor.element_size()
    base = tensor.data_ptr()
    seen: list[tuple[int, ...]] = []
    real_write, real_read = tier.backend.write, tier.backend.read

    def record(call):
        def recorded(request, **how):
            if request.parts == (PART,):  # not the block digests kept beside (memory)
                seen.extend(request.host.ptrs)
            return call(request, **how)

        return recorded

    monkeypatch.setattr(tier.backend, "write", record(real_write))
    monkeypatch.setattr(tier.backend, "read", record(real_read))
    try:
        assert registered == [(base, tensor.numel() * tensor.element_size())]
        expected = tensor[[1, 3]].clone()
        tier.submit_store(make_job(1, [key(1), key(3)], [1, 3]))
        assert [r.success for r in drain(tier)] == [True]
        tensor[[4, 6]] = 0
        tier.submit_load(make_job(2, [key(1), key(3)], [4, 6], promotion=True))
        assert [r.success for r in drain(tier)] == [True]
        assert torch.equal(tensor[[4, 6]], expected)
        chunk_ptrs = [base + c * chunk_bytes for c in (1, 3, 4, 6)]
        assert [row[0] for row in seen] == chunk_ptrs, "a buffer other than the chunk's own"
        assert len(registered) == 1, "registered again per job"
    finally:
        tier.shutdown()


def test_shutdown_leaves_no_thread_or_open_store_file(tmp_path) -> None:
    tier, _ = make_tier("file", str(tmp_path))
    for i in range(4):
        tier.submit_store(make_job(i, [key(i)], [i]))
    tier.submit_load(make_job(9, [key(0)], [5], promotion=True))
    lookup_and_wait(tier, [key(0), key(1)])
    tier.shutdown()
    threads = [t.name for t in threading.enumerate() if t.name.startswith(("kvcore", "kv_file"))]
    assert threads == []
    root = os.path.realpath(str(tmp_path))
    open_files = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(root):
            open_files.append(target)
    assert open_files == []


def test_backend_settings_of_the_helpers_are_what_operators_write(tmp_path) -> None:
    # the docs' example line, as a dict: validated, opened, closed
    entry = {"type": "kvcore", **backend_settings("file", str(tmp_path)), "namespace": "prod"}
    tensor = aligned_tensor(2)
    tier = SecondaryTierFactory.create_secondary_tier(
        entry, memoryview(tensor.numpy()), offloading_spec()
    )
    assert tier.settings.namespace == "prod" and tier.backend.name == "file"
    tier.shutdown()


def test_a_tier_attaching_to_a_filled_store_announces_its_chunks(tmp_path) -> None:
    """Chunks another opener stored before this tier opened are announced from the store's
    listing over the next steps (``LISTED_PER_STEP`` objects a step); one removed meanwhile is
    either never announced or announced and then removed, never left credited."""
    from kvcore_vllm import tier as tier_module

    spec = offloading_spec(enable_kv_cache_events=True)
    config = {"root": str(tmp_path), "rescan_interval_s": 0}
    writer, _ = make_tier("file", "", spec=spec, backend_config=config)
    try:
        for i in range(6):
            writer.submit_store(make_job(i, [key(200 + i)], [i]))
            assert [r.success for r in drain(writer)] == [True]
        late, _ = make_tier("file", "", spec=spec, enable_kv_events=True, backend_config=config)
        try:
            old = tier_module.LISTED_PER_STEP
            tier_module.LISTED_PER_STEP = 2  # several steps
            try:
                assert writer.backend.remove(
                    writer.backend.request("gone", [writer.keys.key(key(205))],
                                           parts=(tier_module.PART,))
                ) == 1  # fmt: skip
                time.sleep(0.3)  # the removal reaches the stream before the steps
                announced: list = []
                for _ in range(6):
                    announced.extend(late.take_events())
            finally:
                tier_module.LISTED_PER_STEP = old
            held: set = set()
            for event in announced:  # a removal only of a chunk announced before it
                if event.removed:
                    assert set(event.keys) <= held, "removed a chunk never announced"
                    held -= set(event.keys)
                else:
                    held |= set(event.keys)
            assert held == set(map(key, range(200, 205)))
        finally:
            late.shutdown()
    finally:
        writer.shutdown()


def test_lookups_answer_only_the_chunks_worth_promoting(tmp_path) -> None:
    """vLLM's lookups of the tier go through kvcore's load-or-recompute decision (the rule of
    the core's tests/test_load_costs.py), weighed by the store's read rate the tier's own loads
    measured: with an engine that computes a chunk ten times faster than this store reads it,
    the chunks found are answered absent; ten times slower, they are hits."""
    keys = [key(i) for i in range(1, 5)]
    results = {}
    for label, factor in (("slow_engine", 10.0), ("fast_engine", 0.1)):
        root = tmp_path / label
        tier, _ = make_tier("file", str(root))
        try:
            tier.submit_store(make_job(1, keys, [0, 1, 2, 3]))
            assert all(r.success for r in drain(tier))
            for _ in range(3):  # promotions, measured by the store's facade
                tier.submit_load(make_job(2, keys, [4, 5, 6, 7]))
                assert all(r.success for r in drain(tier))
            rate = tier.backend.read_rate.figures()["bytes_per_s"]
            chunk_s = tier._chunk_bytes / rate
        finally:
            tier.shutdown()
        tokens_per_s = tier._chunk_tokens / (chunk_s * factor)
        again, _ = make_tier("file", str(root), prefill_tokens_per_s=tokens_per_s)
        try:
            for _ in range(3):
                again.submit_load(make_job(3, keys, [4, 5, 6, 7]))
                assert all(r.success for r in drain(again))
            results[label] = lookup_and_wait(again, keys, ctx=ReqContext(req_id=label))
            declined = again._counts.snapshot().get("chunks_declined", 0)
        finally:
            again.shutdown()
        results[label + "_declined"] = declined
    assert results["slow_engine"] == [LookupResult.HIT] * 4
    assert LookupResult.MISS in results["fast_engine"] and results["fast_engine_declined"] >= 1
