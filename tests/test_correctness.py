"""Issue 11's defects on the core side, each reproduced through the public API.

Every test here failed before its fix: wrong element sizes accepted (silent wrong bytes),
2-byte fp8 scales spaced as 4-byte ones, short host buffers poisoning keys, an infinite
timeout killing the deadline thread, a failed constructor leaking threads, JSON configs
refused, failures indistinguishable from absence, no way to remove data or to change the
weight version.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from memory_backend import MemoryBackend

import kvcore
from kvcore import CacheLayout, HostBuffers, Outcome, hookimpl
from kvcore.transfer import DeviceCache, TransferManager
from kvcore.transfer.scheduler import DeadlineWatchdog, TaskFuture

BLOCK = 4


def lay(**kw) -> CacheLayout:
    base = dict(num_layers=2, num_heads=2, block_size=BLOCK, head_dim=8, num_blocks=8)
    return CacheLayout(**{**base, **kw})


def cache_of(layout: CacheLayout, dtype, scale_dtype=np.float32, seed: int = 0, fill=True):
    rng = np.random.default_rng(seed)

    def tensors(block_shape, dt):
        out = []
        for layer in range(layout.total_layers):
            raw = np.zeros((layout.layer_num_blocks(layer), *block_shape), dtype=dt)
            if fill:
                raw.view(np.uint8)[...] = rng.integers(0, 256, raw.view(np.uint8).shape)
            out.append(raw)
        return out

    k, v = tensors(layout.kv_block_shape, dtype), tensors(layout.kv_block_shape, dtype)
    if layout.dtype.has_scales:
        ks = tensors(layout.scale_block_shape, scale_dtype)
        vs = tensors(layout.scale_block_shape, scale_dtype)
        return DeviceCache(layout, k, v, ks, vs)
    return DeviceCache(layout, k, v)


def keys(n: int, seed: int = 0) -> list[str]:
    tokens = np.random.default_rng(seed).integers(0, 1000, n * BLOCK).tolist()
    return kvcore.block_hashes(tokens, BLOCK, kvcore.KeyScope(namespace=f"c{seed}"))


def manager(layout, cache, backend=MemoryBackend, **cfg) -> TransferManager:
    context = {"layout": layout, "weight_version": cfg.get("weight_version", "")}
    be = kvcore.open_backend(backend, context=context)
    conf = {"layout": layout, "max_model_len": 64, "storage_io": "staged", **cfg}
    tm = TransferManager(conf, cache, be)
    tm._test_backend = be
    return tm


def close(tm: TransferManager) -> None:
    tm.close()
    tm._test_backend.close()


def part_bytes(cache: DeviceCache, block: int) -> list[bytes]:
    return [t.view(np.uint8)[block].tobytes() for p in cache.parts for t in cache.tensors[p]]


# -- item 1: tensors of the wrong element size, or not contiguous -----------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_tensors_of_another_element_size_are_refused_at_once(dtype):
    layout = lay(dtype="bfloat16")
    with pytest.raises(ValueError, match=r"k\[0\] has \d-byte elements; the layout's bfloat16"):
        cache_of(layout, dtype)


def test_non_contiguous_tensors_are_refused_at_once():
    layout = lay()
    wide = np.zeros((layout.num_blocks, 2, BLOCK, 16), dtype=np.uint16)
    strided = [wide[:, :, :, ::2]] * layout.total_layers  # right shape, every other element
    with pytest.raises(ValueError, match="contiguous"):
        DeviceCache(layout, strided, strided)


def test_any_inner_block_order_with_the_layout_bytes_is_accepted():
    layout = lay()
    # vLLM keeps [block_size, heads, head_dim]; kvcore moves whole blocks either way
    vllm_like = [np.zeros((8, BLOCK, 2, 8), dtype=np.uint16) for _ in range(2)]
    DeviceCache(layout, vllm_like, vllm_like)
    wrong = [np.zeros((8, BLOCK, 2, 4), dtype=np.uint16) for _ in range(2)]
    with pytest.raises(ValueError, match="bytes per block"):
        DeviceCache(layout, wrong, wrong)


# -- item 2: fp8 scales of a 2-byte dtype -------------------------------------------------------


def test_two_byte_scales_round_trip_when_the_layout_says_so():
    layout = lay(dtype="block_wise_fp8", scale_dtype="bfloat16")
    src = cache_of(layout, np.uint8, scale_dtype=np.uint16, seed=1)
    tm = manager(layout, src)
    ks = keys(4, seed=2)
    assert tm.write_back({"task_id": "w2", "keys": ks[:2], "device_block_ids": [0, 1]}).result().ok
    w = tm.write_back({"task_id": "w4", "keys": ks, "device_block_ids": [0, 1, 2, 3]}).result()
    assert (w.ok, w.skipped_blocks, w.num_blocks) == (True, 2, 2)
    dst = cache_of(layout, np.uint8, scale_dtype=np.uint16, fill=False)
    tm.restore_caches(dst)
    r = tm.read({"task_id": "r", "keys": ks, "device_block_ids": [4, 5, 6, 7]}).result()
    assert r.num_blocks == 4
    for s, d in zip([0, 1, 2, 3], [4, 5, 6, 7], strict=True):
        assert part_bytes(src, s) == part_bytes(dst, d)
    close(tm)


def test_two_byte_scales_under_a_float32_scale_layout_are_refused():
    layout = lay(dtype="block_wise_fp8")  # scale_dtype float32
    with pytest.raises(ValueError, match="float32 scale elements are 4 bytes"):
        cache_of(layout, np.uint8, scale_dtype=np.uint16)


# -- item 3: a short host buffer must not reach a backend ---------------------------------------


def test_short_host_buffers_are_refused_at_the_door_and_poison_nothing():
    layout = lay()
    be = kvcore.open_backend("memory", context={"layout": layout})
    ks = keys(1, seed=3)
    size = layout.part_bytes("k")
    buf = np.zeros(2 * size, dtype=np.uint8)
    short = HostBuffers(ptrs=((buf.ctypes.data, buf.ctypes.data + size),), nbytes=(size - 8,) * 2)
    with pytest.raises(ValueError, match=r"host\.nbytes"):
        be.write(be.request("w", ks, host=short))
    assert be.query(be.request("q", ks)) == 0
    full = HostBuffers(ptrs=short.ptrs, nbytes=(size, size))
    assert be.write(be.request("w", ks, host=full)) == 1
    be.close()


# -- item 4: every timeout is bounded; the deadline thread cannot die ---------------------------


@pytest.mark.parametrize("timeout", [float("inf"), 1e10, float("nan")])
def test_unbounded_timeouts_are_refused_by_name(timeout):
    layout = lay()
    tm = manager(layout, cache_of(layout, np.uint16))
    with pytest.raises(kvcore.ConfigError, match="timeout_s"):
        tm.read({"task_id": "r", "keys": keys(1), "device_block_ids": [0], "timeout_s": timeout})
    with pytest.raises(kvcore.ConfigError, match="default_timeout_s"):
        TransferManager({"layout": layout, "max_model_len": 8, "default_timeout_s": timeout}, None)
    with pytest.raises(kvcore.ConfigError, match="default_timeout_s"):
        kvcore.open_backend("memory", {"default_timeout_s": timeout})
    close(tm)


def test_the_deadline_thread_survives_an_error_and_keeps_enforcing():
    dog = DeadlineWatchdog()

    def explode(_reason, _fence):
        raise RuntimeError("a broken fallback")

    dog.watch(TaskFuture(time.monotonic(), explode))
    later = TaskFuture(time.monotonic() + 0.2, lambda reason, fence: "answered")
    dog.watch(later)
    assert later.result(timeout=5) == "answered"
    dog.stop()


class _Hangs(MemoryBackend):
    hang_s = 4.0

    @hookimpl
    def kvcore_read(self, request):
        time.sleep(self.hang_s)
        return 0


def test_a_hanging_backend_is_answered_at_the_deadline_after_a_huge_timeout_elsewhere():
    layout = lay()
    tm = manager(layout, cache_of(layout, np.uint16), backend=_Hangs)
    ks = keys(2, seed=4)
    tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": [0, 1]}).result()
    big = tm.read({"task_id": "big", "keys": ks, "device_block_ids": [2, 3], "timeout_s": 6e5})
    t0 = time.monotonic()
    r = tm.read({"task_id": "r", "keys": ks, "device_block_ids": [4, 5], "timeout_s": 0.3}).result(
        timeout=10
    )
    assert r.deadline_missed and r.outcome == "deadline"
    # (half the hang: a busy machine's lateness is not the answer waiting for the hang)
    assert time.monotonic() - t0 < _Hangs.hang_s / 2
    assert big.result(timeout=10).num_blocks == 0
    close(tm)


# -- item 8: a failed constructor leaves nothing running ----------------------------------------


def test_a_failed_constructor_leaks_no_thread_and_closes_its_backend(tmp_path):
    pytest.importorskip("kv_file")
    layout = lay()
    other = cache_of(lay(num_heads=1), np.uint16)  # another layout: restore_caches refuses it
    before = threading.active_count()
    for _ in range(3):
        with pytest.raises(ValueError, match="layout differs"):
            TransferManager(
                {"layout": layout, "max_model_len": 64},
                other,
                "file",
                {"root": str(tmp_path), "rescan_interval_s": 1},
            )
    time.sleep(0.2)
    assert threading.active_count() == before


# -- item 9: configs as JSON strings or files ---------------------------------------------------


def test_backend_configs_may_be_json_strings_or_files(tmp_path):
    layout = lay()
    path = tmp_path / "memory.json"
    path.write_text(json.dumps({"max_objects": 7}))
    for given in ('{"max_objects": 7}', str(path)):
        be = kvcore.open_backend("memory", given)
        assert be.config.max_objects == 7
        be.close()
        tm = TransferManager({"layout": layout, "max_model_len": 8}, None, "memory", given)
        assert tm.backend.config.max_objects == 7
        tm.close()
    with pytest.raises(kvcore.ConfigError, match=r"'memory'.*neither a JSON object nor a file"):
        kvcore.open_backend("memory", "no-such-file.json")


# -- item 10: failure is distinguishable from absence -------------------------------------------


class _Fails(MemoryBackend):
    how = "raise"

    @hookimpl
    def kvcore_read(self, request):
        if self.how == "raise":
            raise OSError("disk on fire")
        if self.how == "report":
            return Outcome(0, "checksum mismatch on every object")
        if self.how == "invalid":
            return request.num_blocks + 1
        return MemoryBackend.kvcore_read(self, request)

    @hookimpl
    def kvcore_write(self, request):
        if self.how == "raise":
            raise OSError("disk on fire")
        return MemoryBackend.kvcore_write(self, request)


@pytest.mark.parametrize(
    ("how", "outcome", "error"),
    [
        ("raise", "backend_error", "OSError: disk on fire"),
        ("report", "backend_error", "checksum mismatch"),
        ("invalid", "invalid_result", "invalid result"),
    ],
)
def test_task_results_say_why_they_fell_short(how, outcome, error):
    layout = lay()
    _Fails.how = "ok"
    tm = manager(layout, cache_of(layout, np.uint16), backend=_Fails)
    ks = keys(2, seed=5)
    assert tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": [0, 1]}).result().ok
    _Fails.how = how
    r = tm.read({"task_id": "r", "keys": ks, "device_block_ids": [2, 3]}).result()
    assert (r.num_blocks, r.outcome, r.ok) == (0, outcome, False)
    assert error in r.error
    w = tm.write_back({"task_id": "w2", "keys": keys(2, seed=6), "device_block_ids": [0, 1]})
    if how == "raise":
        res = w.result()
        assert (res.outcome, res.ok) == ("backend_error", False) and "disk on fire" in res.error
    _Fails.how = "ok"
    close(tm)


def test_absence_is_a_clean_miss():
    layout = lay()
    tm = manager(layout, cache_of(layout, np.uint16))
    r = tm.read({"task_id": "r", "keys": keys(2, seed=7), "device_block_ids": [2, 3]}).result()
    assert (r.num_blocks, r.outcome, r.ok, r.error) == (0, "miss", True, None)
    close(tm)


# -- item 11: removing data, and the weight version in the key scope ---------------------------


def test_remove_and_clear_through_the_facade():
    layout = lay()
    be = kvcore.open_backend("memory", context={"layout": layout, "namespace": "a"})
    other = kvcore.open_backend("memory", context={"layout": layout, "namespace": "b"})
    size = layout.part_bytes("k")
    buf = np.zeros(2 * size * 3, dtype=np.uint8)
    host = HostBuffers(
        ptrs=tuple((buf.ctypes.data + 2 * i * size, buf.ctypes.data + (2 * i + 1) * size)
                   for i in range(3)),
        nbytes=(size, size),
    )  # fmt: skip
    ks = keys(3, seed=8)
    assert be.write(be.request("w", ks, host=host)) == 3
    assert be.remove(be.request("rm", ks[1:2])) == 1
    assert be.remove(be.request("rm", ks[1:2])) == 0  # already gone
    assert be.query(be.request("q", ks)) == 1
    assert be.clear() == 2 * 2 + 2  # two blocks of K and V left, and their digests
    assert be.query(be.request("q", ks)) == 0
    assert other.clear() == 0
    be.close()
    other.close()


class _SlowWrites(MemoryBackend):
    gate = threading.Event()

    @hookimpl
    def kvcore_write(self, request):
        self.gate.wait(10)
        return MemoryBackend.kvcore_write(self, request)


def test_a_weight_update_never_serves_or_stores_across_versions():
    layout = lay()
    _SlowWrites.gate = threading.Event()
    tm = manager(layout, cache_of(layout, np.uint16), backend=_SlowWrites, weight_version="v1")
    ks = keys(2, seed=9)
    pending = tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": [0, 1]})
    tm.set_weight_version("v2")  # the engine loaded new weights while the write was queued
    _SlowWrites.gate.set()
    assert pending.result().num_blocks == 2
    assert tm.query({"task_id": "q", "keys": ks}) == 0  # v1's KV is not v2's
    tm.set_weight_version("v1")
    assert tm.query({"task_id": "q", "keys": ks}) == 2  # it was stored under v1's names
    with pytest.raises(ValueError, match="weight_version"):
        tm.set_weight_version("../etc")
    close(tm)


def test_a_backend_config_can_be_checked_without_opening_the_backend():
    assert kvcore.check_backend_config("memory", {"max_objects": 3}).max_objects == 3
    with pytest.raises(kvcore.ConfigError, match="max_objects"):
        kvcore.check_backend_config("memory", {"max_objects": 0})
    with pytest.raises(kvcore.UnknownBackendError, match="installed backends"):
        kvcore.check_backend_config("nosuch", {})
    # named from where the user wrote it, one line per setting (an adapter's start error)
    with pytest.raises(kvcore.ConfigError) as raised:
        kvcore.check_backend_config(
            "memory", {"max_objects": 0, "nosuch": 1}, where="engine settings: backend_config"
        )
    assert "\n" not in str(raised.value)
    assert str(raised.value).startswith("engine settings: backend_config.max_objects: ")
    assert "; engine settings: backend_config.nosuch: " in str(raised.value)
    assert [f for f, _ in raised.value.fields] == [
        "engine settings: backend_config.max_objects",
        "engine settings: backend_config.nosuch",
    ]


def test_an_engine_adapters_number_settings_take_no_booleans():
    """Python's bool is an int: pydantic took ``true`` as 1 (LMCache's io_threads), in every
    adapter's settings base as in every backend's config (one validator, SettingsModel)."""
    from kvcore.config import EngineBackendSettings

    for field in ("reopen_interval_s", "load_margin", "prefill_tokens_per_s"):
        with pytest.raises(ValueError, match=f"{field}\n.*must be a number, not a boolean"):
            EngineBackendSettings(backend="memory", **{field: True})


def test_a_request_may_name_parts_of_its_own_with_their_sizes_checked():
    """An MLA model's single latent part, stored once for every tensor-parallel rank."""
    layout = lay()
    rank1 = kvcore.open_backend("memory", context={"layout": layout, "rank": 1, "world_size": 2})
    size = 96
    buf = np.arange(2 * size, dtype=np.uint8)
    host = HostBuffers(ptrs=((buf.ctypes.data,), (buf.ctypes.data + size,)), nbytes=(size,))
    ks = keys(2, seed=10)
    req = rank1.request("w", ks, host=host, parts=("latent",), part_bytes=(size,), rank=0,
                        world_size=1)  # fmt: skip
    assert req.object_names[0] == (f"default/{ks[0]}/latent/r0of1",)
    assert rank1.write(req) == 2
    assert rank1.query(rank1.request("q", ks, parts=("latent",), rank=0, world_size=1)) == 2
    assert rank1.query(rank1.request("q", ks, parts=("latent",))) == 0  # rank 1's own names
    short = HostBuffers(ptrs=host.ptrs, nbytes=(size - 1,))
    with pytest.raises(ValueError, match=r"host\.nbytes \[95\] differ from the part sizes \[96\]"):
        rank1.write(rank1.request("w", ks, host=short, parts=("latent",), part_bytes=(size,)))
    rank1.close()
