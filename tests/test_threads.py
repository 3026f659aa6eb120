"""kvcore's threads run on the process's cores, not on the pinning of the thread that starts
them (vLLM's CPU worker pins its main thread to one core before it builds a connector), and a
host-resident cache is announced to the backend once, as staging is."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from memory_backend import MemoryBackend
from test_correctness import cache_of, keys, lay, part_bytes

import kvcore
from kvcore import hookimpl, threads
from kvcore.errors import ConfigError
from kvcore.transfer import TransferManager

ALL_CPUS = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
needs_two_cores = pytest.mark.skipif(
    ALL_CPUS is None or len(ALL_CPUS) < 2, reason="needs CPU affinity and two usable cores"
)


@pytest.fixture(autouse=True)
def _default_io_cpus(monkeypatch) -> Iterator[None]:
    monkeypatch.delenv(threads.IO_CPUS_ENV, raising=False)
    threads.set_io_cpus(None)
    yield
    threads.set_io_cpus(None)


@contextlib.contextmanager
def pinned_to(core: int) -> Iterator[None]:
    """The calling thread on one core, as an engine's OpenMP thread is."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    threads._cached = None  # the union is computed once per process: see it with this pinning
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        threads._cached = None


def affinity_of(prefix: str) -> dict[str, frozenset[int]]:
    return {
        t.name: frozenset(os.sched_getaffinity(t.native_id))
        for t in threading.enumerate()
        if t.name.startswith(prefix) and t.native_id is not None and t.is_alive()
    }


@pytest.mark.parametrize(
    ("text", "cores"),
    [("3", {3}), ("0-3", {0, 1, 2, 3}), ("0-1, 8,10-11", {0, 1, 8, 10, 11}), ("2,2", {2})],
)
def test_core_lists_parse_like_the_kernels(text, cores):
    assert threads.parse_cpu_list(text) == cores


@pytest.mark.parametrize("text", ["", "x", "3-1", "-2", "1-", "0;1"])
def test_a_bad_core_list_names_the_variable(text):
    with pytest.raises(ConfigError, match=threads.IO_CPUS_ENV):
        threads.parse_cpu_list(text)


def test_a_bad_environment_value_is_refused_when_the_manager_starts(monkeypatch):
    monkeypatch.setenv(threads.IO_CPUS_ENV, "2-x")
    layout = lay()
    with pytest.raises(ConfigError, match=r"KVCORE_IO_CPUS: '2-x'"):
        TransferManager({"layout": layout, "max_model_len": 64}, cache_of(layout, np.uint16))


def test_set_io_cpus_refuses_nothing_and_negative_cores():
    for bad in ([], [-1]):
        with pytest.raises(ConfigError, match="io_cpus"):
            threads.set_io_cpus(bad)


@needs_two_cores
def test_threads_started_from_a_pinned_thread_run_on_every_core_of_the_process():
    layout = lay(num_blocks=64)
    src = cache_of(layout, np.uint16, seed=3)
    with pinned_to(min(ALL_CPUS)):
        tm = TransferManager(
            {"layout": layout, "max_model_len": 64, "storage_io": "staged"},
            src,
            kvcore.open_backend(MemoryBackend, context={"layout": layout}),
        )
        try:
            # the io pool starts its threads on first use
            r = tm.write_back({"task_id": "w", "keys": keys(4), "device_block_ids": [0, 1, 2, 3]})
            assert r.result().ok
            assert os.sched_getaffinity(0) == {min(ALL_CPUS)}, "the caller keeps its pinning"
            found = affinity_of("kvcore-")
            for started in ("kvcore-deadlines", "kvcore-read-", "kvcore-write-", "kvcore-io"):
                assert any(n.startswith(started) for n in found), (started, sorted(found))
            assert set(found.values()) == {ALL_CPUS}, found
        finally:
            tm.close()
            tm.backend.close()


@needs_two_cores
def test_a_backends_own_pools_leave_the_pinning_too(tmp_path):
    """kv_file's I/O pool starts lazily, inside a hook called from the pinned thread."""
    pytest.importorskip("kv_file")
    layout = lay(num_blocks=64, num_heads=8, head_dim=256)  # 2 MiB a batch: not done inline
    src = cache_of(layout, np.uint16, seed=4)
    with pinned_to(min(ALL_CPUS)):
        backend = kvcore.open_backend(
            "file", {"root": str(tmp_path), "io_threads": 4}, context={"layout": layout}
        )
        tm = TransferManager({"layout": layout, "max_model_len": 1024}, src, backend)
        try:
            big = keys(32, seed=4)
            result = tm.write_back(
                {"task_id": "w", "keys": big, "device_block_ids": list(range(32))}
            ).result()
            assert result.ok
            found = affinity_of("kv_file")
            assert any(n.startswith("kv_file-io") for n in found), sorted(found)
            assert set(found.values()) == {ALL_CPUS}, found
        finally:
            tm.close()
            backend.close()


needs_thread_nice = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's"
)


def _priority_in(pool) -> tuple[int, int]:
    """(the nice value of a thread of ``pool``, that thread's id)."""
    return pool.submit(
        lambda: (
            os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
            threading.get_native_id(),
        )
    ).result()


@needs_thread_nice
def test_a_background_pool_runs_at_the_lowest_priority_and_leaves_its_caller_alone():
    """For threads that only wait on work done elsewhere (a client that polls a transfer):
    they get a core when no thread at the default priority wants it. The caller's priority,
    and an ordinary pool's, stay what they were."""
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    background = threads.thread_pool(1, "test-background", background=True)
    ordinary = threads.thread_pool(1, "test-ordinary")
    try:
        nice, tid = _priority_in(background)
        assert nice == threads.BACKGROUND_NICE
        assert tid != threading.get_native_id()
        assert _priority_in(ordinary)[0] == mine
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    finally:
        background.shutdown()
        ordinary.shutdown()


@needs_two_cores
def test_the_operator_chooses_the_cores_by_environment(monkeypatch):
    chosen = max(ALL_CPUS)
    monkeypatch.setenv(threads.IO_CPUS_ENV, str(chosen))
    thread = threads.start_thread(threading.Event().wait, "kvcore-probe", args=(0.5,))
    try:
        assert os.sched_getaffinity(thread.native_id) == {chosen}
    finally:
        thread.join()


@needs_two_cores
def test_io_affinity_restores_the_callers_cores():
    with pinned_to(min(ALL_CPUS)):
        with threads.io_affinity():
            assert os.sched_getaffinity(0) == ALL_CPUS
        assert os.sched_getaffinity(0) == {min(ALL_CPUS)}


class _Registering(MemoryBackend):
    """Records what the manager announces (a zero-copy client registers it)."""

    registered: list[tuple[int, int]] = []
    unregistered: list[int] = []

    @hookimpl
    def kvcore_register_buffer(self, ptr, nbytes):
        self.registered.append((ptr, nbytes))

    @hookimpl
    def kvcore_unregister_buffer(self, ptr):
        self.unregistered.append(ptr)


def test_a_host_resident_cache_is_announced_once_and_withdrawn_at_close():
    layout = lay(num_blocks=10)
    # every layer and part carved out of one allocation, as engines allocate their cache
    one = np.zeros(layout.total_layers * 2 * 10 * layout.layer_block_bytes("k") // 2, np.uint16)
    per_layer = np.split(one, layout.total_layers * 2)
    shape = (10, *layout.kv_block_shape)
    k = [t.reshape(shape) for t in per_layer[0::2]]
    v = [t.reshape(shape) for t in per_layer[1::2]]
    cache = kvcore.transfer.DeviceCache(layout, k, v)
    _Registering.registered, _Registering.unregistered = [], []
    backend = kvcore.open_backend(_Registering, context={"layout": layout})
    tm = TransferManager({"layout": layout, "max_model_len": 64}, cache, backend)
    try:
        assert tm.storage_io == "host_resident"
        assert _Registering.registered == [(one.ctypes.data, one.nbytes)], "one merged region"
        one[:] = np.arange(one.size, dtype=np.uint16)
        w = tm.write_back({"task_id": "w", "keys": keys(3), "device_block_ids": [7, 1, 4]})
        assert w.result().ok
        before = part_bytes(cache, 7)
        one[:] = 0
        r = tm.read({"task_id": "r", "keys": keys(3), "device_block_ids": [2, 3, 5]}).result()
        assert r.ok and part_bytes(cache, 2) == before
        assert len(_Registering.registered) == 1, "registered once, not per call"
    finally:
        tm.close()
        backend.close()
    assert _Registering.unregistered == [one.ctypes.data]


def test_a_manager_may_describe_the_same_objects_with_other_layers():
    """An engine whose blocks hold K and V together describes a block as halves of its layer
    list (vLLM's CPU cache through kvcore-vllm); the backend keeps the scheduler's per-layer
    layout. Objects of another size are refused, naming the field."""
    per_layer = lay(num_layers=4, head_dim=8, num_blocks=8)
    paired = lay(num_layers=2, head_dim=16, num_blocks=8)
    assert paired.stores_like(per_layer) and per_layer.stores_like(paired)
    backend = kvcore.open_backend(MemoryBackend, context={"layout": per_layer})
    cache = cache_of(paired, np.uint16, seed=5)
    with TransferManager({"layout": paired, "max_model_len": 64}, cache, backend) as tm:
        assert (
            tm.write_back({"task_id": "w", "keys": keys(2), "device_block_ids": [1, 2]}).result().ok
        )
    wider = lay(num_layers=2, head_dim=8, num_blocks=8)
    assert not wider.stores_like(per_layer)
    with pytest.raises(ConfigError, match=r"layout: .* differs from the backend's context"):
        TransferManager({"layout": wider, "max_model_len": 64}, cache_of(wider, np.uint16), backend)
    backend.close()
