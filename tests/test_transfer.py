"""TransferManager on CPU with Paddle tensors: exact bytes, dedup, faults, concurrency, reuse."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import paddle
import pytest
from memory_backend import MemoryBackend

import kvcore
from kvcore import CacheLayout, hookimpl
from kvcore.transfer import DeviceCache, TransferManager

BLOCK = 8


def layout(dtype: str = "bfloat16", **kw) -> CacheLayout:
    base = dict(
        num_layers=3,
        num_extra_layers=1,
        num_heads=2,
        block_size=BLOCK,
        head_dim=32,
        dtype=dtype,
        num_blocks=24,
        extra_num_blocks=20,
    )
    base.update(kw)
    return CacheLayout(**base)


def _bytes(t: paddle.Tensor) -> np.ndarray:
    return np.from_dlpack(t.view(paddle.uint8)) if t.dtype != paddle.uint8 else np.from_dlpack(t)


def make_cache(lay: CacheLayout, fill: bool = True, seed: int = 0) -> DeviceCache:
    rng = np.random.default_rng(seed)
    paddle_dtype = {
        "bfloat16": "bfloat16",
        "float16": "float16",
        "float32": "float32",
        "uint8": "uint8",
        "block_wise_fp8": "uint8",
    }[lay.dtype.value]

    def tensors(shape_fn, dtype) -> list[paddle.Tensor]:
        out = []
        for layer in range(lay.total_layers):
            t = paddle.zeros(shape_fn(lay.layer_num_blocks(layer)), dtype=dtype)
            if fill:
                view = _bytes(t)
                view[...] = rng.integers(0, 256, view.shape, dtype=np.uint8)
            out.append(t)
        return out

    kv = lambda n: [n, *lay.kv_block_shape]  # noqa: E731
    k, v = tensors(kv, paddle_dtype), tensors(kv, paddle_dtype)
    if lay.dtype.has_scales:
        sc = lambda n: [n, *lay.scale_block_shape]  # noqa: E731
        return DeviceCache(lay, k, v, tensors(sc, "float32"), tensors(sc, "float32"))
    return DeviceCache(lay, k, v)


def block_bytes(cache: DeviceCache, block_id: int) -> list[bytes]:
    return [_bytes(t)[block_id].tobytes() for part in cache.parts for t in cache.tensors[part]]


def keys_for(n_blocks: int, seed: int = 0) -> tuple[list[int], list[str]]:
    tokens = np.random.default_rng(seed).integers(0, 50_000, n_blocks * BLOCK).tolist()
    return tokens, kvcore.block_hashes(tokens, BLOCK, kvcore.KeyScope(namespace=f"t{seed}"))


@pytest.fixture(params=["memory", "file"])
def backend_name(request, tmp_path):
    if request.param == "file":
        pytest.importorskip("kv_file")
        return "file", {"root": str(tmp_path / "store")}
    return MemoryBackend, {}


def manager(lay, backend_spec, cache=None, **cfg) -> TransferManager:
    """A manager on the staged path unless ``storage_io`` says otherwise (the memory backend
    would pick the host-resident path for these host caches: tests of it set it explicitly),
    without block digests (these tests count the backend's calls and objects exactly; the
    digests have their own tests in test_integrity.py)."""
    target, bcfg = backend_spec
    conf = {"layout": lay, "max_model_len": 16 * BLOCK, "storage_io": "staged",
            "verify_blocks": "never", **cfg}  # fmt: skip
    be = kvcore.open_backend(
        target, bcfg, context={"layout": lay}, verify_blocks=conf["verify_blocks"]
    )
    tm = TransferManager(conf, cache if cache is not None else make_cache(lay), be)
    tm._test_backend = be  # closed by the test
    return tm


def close(tm: TransferManager) -> None:
    tm.close()
    tm._test_backend.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "uint8", "block_wise_fp8"])
def test_write_then_read_into_fresh_tensors_is_exact(backend_name, dtype):
    lay = layout(dtype)
    src = make_cache(lay, seed=1)
    tm = manager(lay, backend_name, src)
    _, keys = keys_for(6)
    src_ids = [5, 6, 7, 0, 19, 2]
    w = tm.write_back({"task_id": "w", "keys": keys, "device_block_ids": src_ids}).result()
    assert (w.ok, w.num_blocks, w.block_ids) == (True, 6, src_ids)
    assert w.bytes == 6 * lay.block_bytes
    dst = make_cache(lay, fill=False)
    tm.clear_caches()
    tm.restore_caches(dst)
    dst_ids = [11, 3, 4, 18, 1, 9]
    r = tm.read({"task_id": "r", "keys": keys, "device_block_ids": dst_ids}).result()
    assert (r.ok, r.num_blocks, r.block_ids) == (True, 6, dst_ids)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert block_bytes(src, s) == block_bytes(dst, d)
    untouched = [b for b in range(20) if b not in dst_ids]
    assert all(not any(x.strip(b"\0") for x in block_bytes(dst, b)) for b in untouched)
    close(tm)


def test_dedup_skips_exactly_the_stored_prefix(backend_name):
    lay = layout()
    tm = manager(lay, backend_name)
    _, keys = keys_for(8, seed=2)
    ids = list(range(8))
    first = tm.write_back({"task_id": "a", "keys": keys[:3], "device_block_ids": ids[:3]}).result()
    assert first.num_blocks == 3
    again = tm.write_back({"task_id": "b", "keys": keys, "device_block_ids": ids}).result()
    assert (again.skipped_blocks, again.num_blocks, again.block_ids) == (3, 5, ids[3:])
    assert tm.backend.stats()["blocks.write"] == 3 + 5  # only the unstored suffix was sent
    assert tm.query({"task_id": "q", "keys": keys, "device_block_ids": ids}) == 8
    close(tm)


def test_a_task_names_another_slice_of_each_block(backend_name):
    """``rank``/``world_size`` on a task: the same keys, one object set per slice (a KV head
    of a TP-independent layout), each read back into its own device blocks."""
    lay = layout()
    src = make_cache(lay, seed=4)
    tm = manager(lay, backend_name, src)
    _, keys = keys_for(3, seed=4)
    heads = {0: [0, 2, 4], 1: [1, 3, 5]}  # slice h of each block in device blocks heads[h]
    for h, ids in heads.items():
        task = {"task_id": f"w{h}", "keys": keys, "device_block_ids": ids, "rank": h,
                "world_size": 2}  # fmt: skip
        assert tm.write_back(task).result().num_blocks == 3
    assert tm.query({"task_id": "q", "keys": keys}) == 0, "the context's own slice was written"
    for h in heads:
        assert tm.query({"task_id": "q", "keys": keys, "rank": h, "world_size": 2}) == 3
    assert tm.query({"task_id": "q", "keys": keys, "rank": 0, "world_size": 4}) == 0
    dst = make_cache(lay, fill=False)
    tm.clear_caches()
    tm.restore_caches(dst)
    back = {0: [10, 11, 12], 1: [13, 14, 15]}
    for h, ids in back.items():
        task = {"task_id": f"r{h}", "keys": keys, "device_block_ids": ids, "rank": h,
                "world_size": 2}  # fmt: skip
        assert tm.read(task).result().num_blocks == 3
    for h in heads:
        for s_id, d_id in zip(heads[h], back[h], strict=True):
            assert block_bytes(src, s_id) == block_bytes(dst, d_id)
    close(tm)
    for bad, field in (({"rank": 1}, "rank given alone"), ({"world_size": 2}, "world_size given"),
                       ({"rank": 2, "world_size": 2}, "not below")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            kvcore.schemas.QueryTask(task_id="q", keys=keys, **bad)


def test_read_restores_only_the_leading_run(backend_name):
    lay = layout()
    tm = manager(lay, backend_name)
    _, keys = keys_for(6, seed=3)
    tm.write_back({"task_id": "a", "keys": keys[:2], "device_block_ids": [0, 1]}).result()
    tm.write_back({"task_id": "b", "keys": keys[3:], "device_block_ids": [3, 4, 5]}).result()
    r = tm.read({"task_id": "r", "keys": keys, "device_block_ids": [10, 11, 12, 13, 14, 15]})
    res = r.result()
    assert (res.num_blocks, res.block_ids) == (2, [10, 11])
    assert tm.stats()["misses.read"] == 4
    close(tm)


class _Counting(MemoryBackend):
    """Counts the hook calls a read costs."""

    calls: list[str] = []

    @hookimpl
    def kvcore_query(self, request):
        _Counting.calls.append("query")
        return MemoryBackend.kvcore_query(self, request)

    @hookimpl
    def kvcore_read(self, request):
        _Counting.calls.append("read")
        return MemoryBackend.kvcore_read(self, request)


@pytest.mark.parametrize("storage_io", ["staged", "host_resident"])
def test_a_read_asks_no_query_and_a_block_gone_since_the_lookup_is_a_miss(storage_io):
    """The engine looked its blocks up before it asked for them: the read is one backend call
    per span, no query; a block removed in between ends the run as a counted miss."""
    lay = layout()
    tm = manager(lay, (_Counting, {}), storage_io=storage_io)
    _, keys = keys_for(4, seed=9)
    tm.write_back({"task_id": "w", "keys": keys, "device_block_ids": [0, 1, 2, 3]}).result()
    _Counting.calls.clear()
    res = tm.read({"task_id": "r", "keys": keys, "device_block_ids": [4, 5, 6, 7]}).result()
    assert (res.num_blocks, res.ok) == (4, True)
    assert _Counting.calls == ["read"]
    backend = tm._test_backend
    backend.remove(backend.request("gone", keys[2:3], start_block=2))
    _Counting.calls.clear()
    res = tm.read({"task_id": "r2", "keys": keys, "device_block_ids": [8, 9, 10, 11]}).result()
    assert (res.num_blocks, res.block_ids, res.ok) == (2, [8, 9], True)  # a miss, not a failure
    assert _Counting.calls == ["read"]
    assert tm.stats()["misses.read"] == 2
    close(tm)


def test_selective_write_through_waits_for_hits():
    lay = layout()
    tm = manager(lay, (MemoryBackend, {}), write_policy="selective", selective_min_hits=2)
    _, keys = keys_for(4, seed=4)
    task = {"task_id": "w", "keys": keys, "device_block_ids": [0, 1, 2, 3]}
    assert tm.write_back(task).result().num_blocks == 0  # first use: not yet worth storing
    assert tm.write_back(task).result().num_blocks == 4  # second use: stored
    assert tm.write_back(task).result().skipped_blocks == 4
    close(tm)


def test_swap_round_trip_through_host_cache():
    lay = layout("block_wise_fp8")
    src = make_cache(lay, seed=5)
    tm = manager(lay, (MemoryBackend, {}), src, num_host_blocks=8)
    out = tm.swap(
        {
            "task_id": "s",
            "direction": "to_host",
            "device_block_ids": [4, 5, 9],
            "host_block_ids": [0, 1, 7],
        }
    ).result()
    assert out.ok and out.num_blocks == 3
    want = [block_bytes(src, b) for b in (4, 5, 9)]
    dst = make_cache(lay, fill=False)
    tm._cache = dst  # same host cache, fresh device tensors
    back = tm.swap(
        {
            "task_id": "t",
            "direction": "to_device",
            "device_block_ids": [1, 2, 3],
            "host_block_ids": [0, 1, 7],
        }
    ).result()
    assert back.ok
    assert [block_bytes(dst, b) for b in (1, 2, 3)] == want
    close(tm)


class _Faulty(MemoryBackend):
    mode = "raise"

    def _fault(self, request):
        if self.mode == "raise":
            raise OSError("storage exploded")
        if self.mode == "sleep":
            time.sleep(3)
        return 0

    @hookimpl
    def kvcore_query(self, request):
        if self.mode == "query":
            return self._fault(request)
        return MemoryBackend.kvcore_query(self, request)

    @hookimpl
    def kvcore_read(self, request):
        return self._fault(request)

    @hookimpl
    def kvcore_write(self, request):
        return self._fault(request)


@pytest.mark.parametrize("mode", ["raise", "sleep", "fail"])
def test_faulty_backend_yields_counted_misses_within_deadline(mode, caplog):
    lay = layout()
    _Faulty.mode = mode
    tm = manager(lay, (_Faulty, {}))
    _, keys = keys_for(4, seed=6)
    t0 = time.monotonic()
    w = tm.write_back(
        {"task_id": "w", "keys": keys, "device_block_ids": [0, 1, 2, 3], "timeout_s": 0.5}
    ).result(timeout=5)
    assert time.monotonic() - t0 < 1.5
    assert w.num_blocks == 0 and not w.ok
    if mode == "sleep":
        assert w.deadline_missed
        assert tm.stats()["deadline_missed.write"] == 1
    if mode == "raise":
        assert tm.backend.stats()["errors.write"] == 1
        assert "storage exploded" in caplog.text
    _Faulty.mode = "ok"
    close(tm)


def test_late_backend_never_scatters_after_the_deadline():
    lay = layout()
    tm = manager(lay, (MemoryBackend, {}))
    _, keys = keys_for(2, seed=7)
    tm.write_back({"task_id": "w", "keys": keys, "device_block_ids": [0, 1]}).result()
    dst = make_cache(lay, fill=False)
    tm._cache = dst
    real_read = tm.backend._plain.read_hook

    def slow_read(**kw):
        time.sleep(0.6)
        return real_read(**kw)

    tm.backend._plain.read_hook = slow_read
    res = tm.read(
        {"task_id": "r", "keys": keys, "device_block_ids": [5, 6], "timeout_s": 0.2}
    ).result(timeout=5)
    assert res.deadline_missed and res.num_blocks == 0
    time.sleep(0.8)  # the backend finishes late
    assert not any(x.strip(b"\0") for b in (5, 6) for x in block_bytes(dst, b))
    close(tm)


def test_concurrent_tasks(backend_name):
    lay = layout()
    tm = manager(lay, backend_name, read_workers=2, write_workers=2)
    errors: list[str] = []

    def worker(k: int) -> None:
        try:
            _, keys = keys_for(3, seed=100 + k)
            ids = [3 * (k % 6), 3 * (k % 6) + 1, 3 * (k % 6) + 2]
            for i in range(5):
                w = tm.write_back(
                    {"task_id": f"w{k}.{i}", "keys": keys, "device_block_ids": ids}
                ).result(timeout=30)
                assert w.ok, w
                r = tm.read({"task_id": f"r{k}.{i}", "keys": keys, "device_block_ids": ids}).result(
                    timeout=30
                )
                assert r.num_blocks == 3, r
        except BaseException as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    close(tm)


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_staging_is_reused_not_allocated_per_task():
    lay = layout(num_layers=8, head_dim=64)
    tm = manager(lay, (MemoryBackend, {}))
    _, keys = keys_for(4, seed=8)
    task = {"task_id": "r", "keys": keys, "device_block_ids": [0, 1, 2, 3]}
    tm.write_back({**task, "task_id": "w"}).result()
    staging_ids = {id(b) for b in tm._blocks._storage._read_pool.buffers}
    for _ in range(100):  # warm up allocator pools
        tm.read(task).result()
    before = _rss_mib()
    for _ in range(1000):
        assert tm.read(task).result().num_blocks == 4
    grown = _rss_mib() - before
    assert grown < 8, f"resident memory grew {grown:.1f} MiB over 1000 tasks"
    assert {id(b) for b in tm._blocks._storage._read_pool.buffers} == staging_ids
    close(tm)


def test_full_queue_rejects_with_a_result():
    lay = layout()
    _Faulty.mode = "sleep"
    tm = manager(lay, (_Faulty, {}), write_workers=1, queue_depth=1, submit_wait_s=0.05)
    _, keys = keys_for(1, seed=9)
    futs = [
        tm.write_back({"task_id": f"w{i}", "keys": keys, "device_block_ids": [0], "timeout_s": 0.3})
        for i in range(4)
    ]
    results = [f.result(timeout=5) for f in futs]
    assert any(r.error and "queue is full" in r.error for r in results)
    assert tm.stats()["rejected.write"] >= 1
    _Faulty.mode = "ok"
    close(tm)


def test_clear_rejects_until_restore():
    lay = layout()
    tm = manager(lay, (MemoryBackend, {}))
    _, keys = keys_for(2, seed=10)
    assert tm.clear_caches()
    assert not tm.caches_ready
    with pytest.raises(RuntimeError, match="restore_caches"):
        tm.read({"task_id": "r", "keys": keys, "device_block_ids": [0, 1]})
    tm.restore_caches(make_cache(lay))
    assert tm.write_back({"task_id": "w", "keys": keys, "device_block_ids": [0, 1]}).result().ok
    close(tm)


def test_bad_input_names_the_field():
    lay = layout()
    tm = manager(lay, (MemoryBackend, {}))
    with pytest.raises(kvcore.ConfigError, match="device_block_ids"):
        tm.read({"task_id": "r", "keys": ["a", "b"], "device_block_ids": [1]})
    with pytest.raises(ValueError, match=r"device_block_ids\[1\] = 99"):
        tm.read({"task_id": "r", "keys": ["a", "b"], "device_block_ids": [1, 99]})
    with pytest.raises(kvcore.ConfigError, match="timeout_s"):
        tm.read({"task_id": "r", "keys": ["a"], "device_block_ids": [1], "timeout_s": -1})
    with pytest.raises(kvcore.ConfigError, match="max_model_len"):
        TransferManager({"layout": lay}, None, None)
    close(tm)


class _TokenIndex(MemoryBackend):
    capabilities = kvcore.Capabilities(addressing="token", io="host", token_index=True)
    flushes: list[tuple[int, int, bool, int]] = []

    @hookimpl
    def kvcore_flush_token_index(self, request, resident_on_device):
        self.flushes.append(
            (request.start_block, request.num_blocks, resident_on_device, len(request.token_ids))
        )
        return request.num_blocks


def test_flush_after_read_and_on_host_eviction():
    lay = layout()
    _TokenIndex.flushes = []
    tm = manager(lay, (_TokenIndex, {}))
    tokens, keys = keys_for(5, seed=11)
    tm.write_back(
        {
            "task_id": "w",
            "keys": keys[2:],
            "device_block_ids": [2, 3, 4],
            "token_ids": tokens,
            "start_block": 2,
        }
    ).result()
    r = tm.read(
        {
            "task_id": "r",
            "keys": keys[2:],
            "device_block_ids": [7, 8, 9],
            "token_ids": tokens,
            "start_block": 2,
        }
    ).result()
    assert r.num_blocks == 3
    assert _TokenIndex.flushes == [(2, 3, True, len(tokens))]
    ev = tm.evicted_from_host("e", tokens, start_block=3).result()
    assert ev.num_blocks == 2
    assert _TokenIndex.flushes[-1] == (3, 2, False, len(tokens))
    with pytest.raises(ValueError, match="token_ids"):
        tm.read({"task_id": "x", "keys": keys, "device_block_ids": [0, 1, 2, 3, 4]})
    close(tm)


def test_prometheus_export_has_counters_and_histograms():
    lay = layout()
    tm = manager(lay, (MemoryBackend, {}))
    _, keys = keys_for(2, seed=12)
    tm.write_back({"task_id": "w", "keys": keys, "device_block_ids": [0, 1]}).result()
    text = tm.prometheus()
    assert 'kvcore_transfer_blocks_written_total{op="write",rank="0"} 2' in text
    assert 'kvcore_transfer_latency_seconds_count{op="write",rank="0"} 1' in text
    assert 'kvcore_backend_calls_total{backend="MemoryBackend",op="write"} 1' in text
    assert "kvcore_backend_backend_objects" in text
    close(tm)


def test_combine_ranks_is_the_minimum():
    from kvcore.transfer import combine_ranks

    assert combine_ranks([5, 3, 4]) == 3
    assert combine_ranks([]) == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "block_wise_fp8"])
def test_device_io_backend_round_trip_and_flush(dtype):
    from memory_backend import DeviceMemoryBackend

    lay = layout(dtype)
    src = make_cache(lay, seed=13)
    tm = manager(lay, (DeviceMemoryBackend, {}), src, storage_io="device")
    assert tm.storage_io == "device"
    tokens, keys = keys_for(4, seed=13)
    src_ids = [1, 7, 3, 9]
    w = tm.write_back(
        {"task_id": "w", "keys": keys, "device_block_ids": src_ids, "token_ids": tokens}
    ).result()
    assert (w.num_blocks, w.block_ids, w.bytes) == (4, src_ids, 4 * lay.block_bytes)
    assert tm.memory_bytes()["staging_bytes"] == 0  # device-I/O backends need no staging
    dst = make_cache(lay, fill=False)
    tm.restore_caches(dst)
    r = tm.read(
        {
            "task_id": "r",
            "keys": keys[1:],
            "device_block_ids": [2, 4, 6],
            "token_ids": tokens,
            "start_block": 1,
        }
    ).result()
    assert (r.num_blocks, r.block_ids) == (3, [2, 4, 6])
    for s, d in zip(src_ids[1:], [2, 4, 6], strict=True):
        assert block_bytes(src, s) == block_bytes(dst, d)
    assert tm.backend.plugin.flushes == [(1, 3, True)]
    close(tm)


def test_pipelined_spans_keep_leading_run_semantics(backend_name):
    lay = layout()
    src = make_cache(lay, seed=14)
    tm = manager(lay, backend_name, src, pipeline_blocks=2)
    _, keys = keys_for(7, seed=14)
    ids = [0, 1, 2, 3, 4, 5, 6]
    w = tm.write_back({"task_id": "w", "keys": keys, "device_block_ids": ids}).result()
    assert (w.num_blocks, w.block_ids) == (7, ids)
    dst = make_cache(lay, fill=False)
    tm.restore_caches(dst)
    out = [10, 11, 12, 13, 14, 15, 16]
    r = tm.read({"task_id": "r", "keys": keys, "device_block_ids": out}).result()
    assert (r.num_blocks, r.block_ids) == (7, out)
    for s, d in zip(ids, out, strict=True):
        assert block_bytes(src, s) == block_bytes(dst, d)
    close(tm)


class _RefusesAfter(MemoryBackend):
    limit = 5  # objects stored in total before the store is "full"

    @hookimpl
    def kvcore_write(self, request):
        room = max(0, self.limit - len(self._objects)) // len(request.parts)
        n = min(room, request.num_blocks)
        if n == 0:
            return 0
        from dataclasses import replace

        part = replace(
            request,
            block_keys=request.block_keys[:n],
            object_names=request.object_names[:n],
            host=kvcore.HostBuffers(request.host.ptrs[:n], request.host.nbytes),
        )
        return MemoryBackend.kvcore_write(self, part)


def test_pipelined_write_stops_at_the_first_short_span():
    lay = layout()
    _RefusesAfter.limit = 2 * 3  # three blocks of (k, v)
    tm = manager(lay, (_RefusesAfter, {}), pipeline_blocks=2)
    _, keys = keys_for(6, seed=15)
    w = tm.write_back({"task_id": "w", "keys": keys, "device_block_ids": list(range(6))}).result()
    assert (w.ok, w.num_blocks, w.block_ids) == (False, 3, [0, 1, 2])
    assert tm.query({"task_id": "q", "keys": keys, "device_block_ids": list(range(6))}) == 3
    close(tm)


def test_tasks_longer_than_the_staging_are_refused_by_name():
    lay = layout()
    tm = manager(lay, (MemoryBackend, {}))  # max_model_len = 16 blocks
    _, keys = keys_for(17, seed=16)
    with pytest.raises(ValueError, match="keys: 17 blocks exceed"):
        tm.read({"task_id": "r", "keys": keys, "device_block_ids": list(range(17))})
    close(tm)


def test_clear_answers_running_tasks_so_nothing_lands_in_freed_tensors():
    lay = layout()
    tm = manager(lay, (MemoryBackend, {}))
    _, keys = keys_for(2, seed=17)
    tm.write_back({"task_id": "w", "keys": keys, "device_block_ids": [0, 1]}).result()
    old = make_cache(lay, fill=False)
    tm.restore_caches(old)
    real_read = tm.backend._plain.read_hook

    def slow_read(**kw):
        time.sleep(0.8)
        return real_read(**kw)

    tm.backend._plain.read_hook = slow_read
    fut = tm.read({"task_id": "r", "keys": keys, "device_block_ids": [5, 6], "timeout_s": 30})
    time.sleep(0.1)
    assert tm.clear_caches(timeout_s=0.1) is False  # the read is still running
    res = fut.result(timeout=1)
    assert res.num_blocks == 0 and res.error == "caches cleared while the task ran"
    time.sleep(1.0)  # the backend returns; the worker must not scatter into `old`
    assert not any(x.strip(b"\0") for b in (5, 6) for x in block_bytes(old, b))
    close(tm)


def test_transfer_config_takes_environment_overrides(monkeypatch):
    monkeypatch.setenv("KVCORE_TRANSFER_WRITE_WORKERS", "3")
    monkeypatch.setenv("KVCORE_TRANSFER_WRITE_POLICY", "selective")
    tm = manager(layout(), (MemoryBackend, {}), write_workers=1)
    assert (tm.config.write_workers, tm.config.write_policy) == (3, "selective")
    close(tm)
    monkeypatch.setenv("KVCORE_TRANSFER_QUEUE_DEPTH", "none")
    with pytest.raises(kvcore.ConfigError, match="queue_depth"):
        manager(layout(), (MemoryBackend, {}))


def test_selective_policy_counts_uses_in_a_bounded_table():
    from kvcore.transfer.policy import WritePolicy

    p = WritePolicy("selective", min_hits=2, table_size=3)
    p.used(["a", "b", "c"])
    assert p.eligible_end(["a", "b", "c"], 0) == 0
    p.used(["a", "b"])
    assert p.eligible_end(["a", "b", "c"], 0) == 2  # c was used once: the run stops there
    p.used(["d", "e"])  # pushes the least recently used keys (c, then a) out of the table
    p.used(["a"])
    assert p.eligible_end(["a"], 0) == 0  # a starts again from one use
    assert p.eligible_end(["b", "x"], 1) == 1  # from a stored prefix on, x is not eligible
    assert WritePolicy("write_through", 2, 3).eligible_end(["x", "y"], 1) == 2


def test_ranks_name_their_own_objects_and_combine_by_minimum(tmp_path):
    pytest.importorskip("kv_file")
    from kvcore.transfer import combine_ranks

    lay = layout()
    root = {"root": str(tmp_path / "shared")}
    managers = []
    for rank in (0, 1):
        tm = TransferManager(
            {"layout": lay, "max_model_len": 16 * BLOCK, "rank": rank, "world_size": 2},
            make_cache(lay, seed=20 + rank),
            "file",
            backend_config=root,
        )
        managers.append(tm)
    _, keys = keys_for(4, seed=20)
    ids = [0, 1, 2, 3]
    # rank 0 stores all four blocks, rank 1 only the first two: one root, separate objects
    assert (
        managers[0]
        .write_back({"task_id": "w0", "keys": keys, "device_block_ids": ids})
        .result()
        .num_blocks
        == 4
    )
    assert (
        managers[1]
        .write_back({"task_id": "w1", "keys": keys[:2], "device_block_ids": ids[:2]})
        .result()
        .num_blocks
        == 2
    )
    q = {"task_id": "q", "keys": keys, "device_block_ids": ids}
    runs = [tm.query(q) for tm in managers]
    assert runs == [4, 2]
    assert combine_ranks(runs) == 2
    # a cache written with another TP degree is never read
    other = TransferManager(
        {"layout": lay, "max_model_len": 16 * BLOCK, "rank": 0, "world_size": 1},
        make_cache(lay),
        "file",
        backend_config=root,
    )
    assert other.query(q) == 0
    for tm in (*managers, other):
        tm.close()


def test_an_opened_backend_must_match_the_managers_rank_and_layout():
    lay = layout()
    be = kvcore.open_backend(MemoryBackend, context={"layout": lay, "rank": 1, "world_size": 2})
    with pytest.raises(kvcore.ConfigError, match="rank: 0 differs"):
        TransferManager({"layout": lay, "max_model_len": 64}, make_cache(lay), be)
    other = kvcore.open_backend(MemoryBackend, context={"layout": layout("float16")})
    with pytest.raises(kvcore.ConfigError, match="layout"):
        TransferManager({"layout": lay, "max_model_len": 64}, make_cache(lay), other)
    be.close()
    other.close()


def test_close_never_hangs_on_a_stuck_backend_and_frees_nothing_in_use():
    lay = layout()
    tm = manager(lay, (MemoryBackend, {}))
    _, keys = keys_for(2, seed=21)
    tm.write_back({"task_id": "w", "keys": keys, "device_block_ids": [0, 1]}).result()
    real_read = tm.backend._plain.read_hook
    release = threading.Event()

    def stuck_read(**kw):
        release.wait(10)
        return real_read(**kw)  # writes into the staging buffer after close() returned

    tm.backend._plain.read_hook = stuck_read
    fut = tm.read({"task_id": "r", "keys": keys, "device_block_ids": [5, 6], "timeout_s": 30})
    time.sleep(0.1)
    t0 = time.monotonic()
    tm.close(timeout_s=0.3)
    assert time.monotonic() - t0 < 5.0  # half the stuck read's 10 s: not waiting for it
    assert fut.result(timeout=1).error == "the transfer manager closed while the task ran"
    release.set()  # the stuck call now writes into its staging buffer: still allocated
    time.sleep(0.3)
    tm._test_backend.close()


@pytest.mark.parametrize(
    "config",
    [
        {"max_model_len": 64},
        {"max_model_len": 64, "context": {"rank": 0}},
        {"max_model_len": 64, "rank": 0, "namespace": "m"},
    ],
    ids=["no engine facts", "context without layout", "top-level facts without layout"],
)
def test_a_config_without_its_engine_layout_names_layout(config: dict) -> None:
    """Not ``context: Field required`` (an internal field): the user left out the layout."""
    with pytest.raises(kvcore.ConfigError) as info:
        TransferManager(config, None, None)
    message = str(info.value)
    assert "\n  layout: missing: the engine's cache layout" in message, message
    assert "context: Field required" not in message
