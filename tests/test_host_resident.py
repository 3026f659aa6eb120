"""The host-resident path: a backend reads into and writes from the engine's host cache blocks
in place (no staging), fenced so that nothing touches a block after its task was answered."""

from __future__ import annotations

import time

import numpy as np
import pytest
from memory_backend import MemoryBackend
from test_correctness import cache_of, keys, lay, part_bytes

import kvcore
from kvcore import hookimpl
from kvcore.transfer import TransferManager
from kvcore.transfer.storage import StagedIO


class _Slow(MemoryBackend):
    read_s = 0.0
    write_s = 0.0

    @hookimpl
    def kvcore_read(self, request):
        time.sleep(self.read_s)
        return MemoryBackend.kvcore_read(self, request)

    @hookimpl
    def kvcore_write(self, request):
        time.sleep(self.write_s)
        return MemoryBackend.kvcore_write(self, request)


@pytest.fixture
def slow():
    _Slow.read_s = _Slow.write_s = 0.0
    yield _Slow
    _Slow.read_s = _Slow.write_s = 0.0


def resident(layout, cache, backend=MemoryBackend, **cfg) -> TransferManager:
    be = kvcore.open_backend(backend, context={"layout": layout})
    tm = TransferManager({"layout": layout, "max_model_len": 64, **cfg}, cache, be)
    tm._test_backend = be
    return tm


def close(tm: TransferManager) -> None:
    tm.close()
    tm._test_backend.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "uint8", "block_wise_fp8"])
def test_round_trip_in_place_is_exact_and_needs_no_staging(dtype):
    layout = lay(dtype=dtype, num_extra_layers=1, extra_num_blocks=6, num_blocks=10)
    np_dtype = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}.get(
        dtype, np.uint8
    )

    src, dst = cache_of(layout, np_dtype, seed=1), cache_of(layout, np_dtype, fill=False)
    tm = resident(layout, src)
    assert tm.storage_io == "host_resident"
    assert tm.memory_bytes()["staging_bytes"] == 0
    ks = keys(5, seed=1)
    src_ids, dst_ids = [4, 0, 5, 2, 1], [3, 5, 0, 1, 4]
    w = tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": src_ids}).result()
    assert (w.ok, w.num_blocks, w.outcome) == (True, 5, "complete")
    tm.restore_caches(dst)
    r = tm.read({"task_id": "r", "keys": ks, "device_block_ids": dst_ids}).result()
    assert (r.ok, r.num_blocks, r.block_ids) == (True, 5, dst_ids)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert part_bytes(src, s) == part_bytes(dst, d)
    assert not any(x.strip(b"\0") for x in part_bytes(dst, 2))  # untouched block
    close(tm)


def test_a_late_read_is_fenced_the_answer_waits_and_nothing_lands_afterwards(slow):
    layout = lay()
    src, dst = cache_of(layout, np.uint16, seed=2), cache_of(layout, np.uint16, fill=False)
    tm = resident(layout, src, backend=slow, fence_grace_s=3.0)
    ks = keys(3, seed=2)
    tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": [0, 1, 2]}).result()
    tm.restore_caches(dst)
    slow.read_s = 0.5
    t0 = time.monotonic()
    r = tm.read(
        {"task_id": "r", "keys": ks, "device_block_ids": [5, 6, 7], "timeout_s": 0.1}
    ).result(timeout=10)
    waited = time.monotonic() - t0
    assert 0.4 < waited < 3.0  # held by the fence until the backend returned
    assert r.outcome == "deadline" and r.deadline_missed
    listed = r.block_ids
    assert listed == [5, 6, 7][: len(listed)]
    snapshot = {b: part_bytes(dst, b) for b in range(8)}
    time.sleep(0.3)
    assert {b: part_bytes(dst, b) for b in range(8)} == snapshot  # nothing after the answer
    for s, d in zip([0, 1, 2], listed, strict=False):
        assert part_bytes(src, s) == part_bytes(dst, d)
    close(tm)


def test_a_backend_that_breaks_the_fence_is_reported_and_loses_direct_access(slow):
    layout = lay()
    src, dst = cache_of(layout, np.uint16, seed=3), cache_of(layout, np.uint16, fill=False)
    tm = resident(layout, src, backend=slow, fence_grace_s=0.2)
    ks = keys(2, seed=3)
    tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": [0, 1]}).result()
    tm.restore_caches(dst)
    # the call outlasts the answer (deadline 0.1 s + grace 0.2 s) tenfold: a busy machine's
    # lateness cannot make the answer wait for it, as the bound below would show (half of it)
    slow.read_s = 3.0
    t0 = time.monotonic()
    r = tm.read({"task_id": "r", "keys": ks, "device_block_ids": [4, 5], "timeout_s": 0.1}).result(
        timeout=10
    )
    assert time.monotonic() - t0 < slow.read_s / 2  # answered at deadline + grace, not after
    assert r.outcome == "deadline" and "still using the engine's blocks" in r.error
    # the call ends; the manager stops trusting the backend with its blocks
    until = time.monotonic() + 30
    while not isinstance(tm._blocks._io(), StagedIO) and time.monotonic() < until:
        time.sleep(0.05)
    assert isinstance(tm._blocks._io(), StagedIO)
    assert tm.stats()["fence_broken.read"] == 1
    slow.read_s = 0.0
    again = cache_of(layout, np.uint16, fill=False)
    tm.restore_caches(again)
    r2 = tm.read({"task_id": "r2", "keys": ks, "device_block_ids": [6, 7]}).result()
    assert r2.num_blocks == 2 and part_bytes(again, 6) == part_bytes(src, 0)
    close(tm)


def test_a_write_that_breaks_the_fence_is_removed_from_the_store(slow):
    layout = lay()
    tm = resident(layout, cache_of(layout, np.uint16, seed=4), backend=slow, fence_grace_s=0.2)
    ks = keys(2, seed=4)
    slow.write_s = 0.8
    w = tm.write_back(
        {"task_id": "w", "keys": ks, "device_block_ids": [0, 1], "timeout_s": 0.1}
    ).result(timeout=10)
    assert w.outcome == "deadline" and w.num_blocks == 0
    time.sleep(1.2)  # the late write lands, then is removed: its bytes may mix reused blocks
    slow.write_s = 0.0
    assert tm.query({"task_id": "q", "keys": ks}) == 0
    close(tm)
