"""kvcore.runner.HostRunner: the one engine-side path of host lookups, reads and writes.

Every test bounds work, not time: a job that must wait is held by an event the test sets,
and a deadline that must pass is waited for (not raced).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

import kvcore
from kvcore import BlockRequest, HostBuffers, Outcome
from kvcore.memory_backend import MemoryBackend
from kvcore.runner import COUNTERS, HostResult, HostRunner

SIZE = 64  # bytes of each test object
#: every test buffer, alive until the module's tests end (requests hold raw addresses)
_ALIVE: list[np.ndarray] = []


class _Admitting(MemoryBackend):
    """The memory backend with an admission policy: a block is admitted at its second offer
    (second-hit, as kv_file's), and every call is recorded."""

    offers: list[list[str]]

    def __init__(self, config, context) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, context)
        self.seen: set[str] = set()
        self.offers = []
        self.writes: list[list[str]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.fail_on: set[str] = set()

    @kvcore.hookimpl
    def kvcore_admit(self, request: BlockRequest) -> int:
        keys = list(request.block_keys)
        self.offers.append(keys)
        admitted = len(keys)
        for i, key in enumerate(keys):
            if key not in self.seen and admitted == len(keys):
                admitted = i
            self.seen.add(key)
        return admitted

    @kvcore.hookimpl
    def kvcore_write(self, request: BlockRequest) -> int:
        self.entered.set()
        self.hold.wait()
        if "obj" in request.parts:  # not the block digests the facade keeps beside them
            self.writes.append(list(request.block_keys))
        for i, key in enumerate(request.block_keys):
            if key in self.fail_on:
                done = super().kvcore_write(request.slice(0, i, host=request.host.slice(0, i)))
                return Outcome(int(done), f"cannot store {key}")
        return super().kvcore_write(request)

    @kvcore.hookimpl
    def kvcore_read(self, request: BlockRequest) -> int:
        for i, key in enumerate(request.block_keys):
            if key in self.fail_on:
                done = super().kvcore_read(request.slice(0, i, host=request.host.slice(0, i)))
                return Outcome(int(done), f"cannot read {key}")
        return super().kvcore_read(request)


class _Unreachable(MemoryBackend):
    def __init__(self, config, context) -> None:  # type: ignore[no-untyped-def]
        raise ConnectionError("no store here")


@pytest.fixture
def backend() -> kvcore.Backend:
    opened = kvcore.open_backend(_Admitting, context={"namespace": "runner"})
    yield opened
    opened.close()


def _plugin(backend: kvcore.Backend) -> _Admitting:
    plugin = backend.plugin
    assert isinstance(plugin, _Admitting)
    return plugin


class _Buffers:
    """One object of SIZE bytes per block, in a numpy array the test keeps alive."""

    def __init__(self, n: int, fill: int = 0) -> None:
        self.data = np.full((n, SIZE), fill, dtype=np.uint8)
        _ALIVE.append(self.data)

    def host(self, lo: int = 0, hi: int | None = None) -> HostBuffers:
        hi = len(self.data) if hi is None else hi
        base = self.data.ctypes.data
        return HostBuffers(ptrs=tuple((base + i * SIZE,) for i in range(lo, hi)), nbytes=(SIZE,))


def _request(
    backend: kvcore.Backend, keys: Sequence[str], buffers: _Buffers | None = None
) -> BlockRequest:
    return backend.request(
        "t",
        keys,
        host=None if buffers is None else buffers.host(),
        parts=("obj",),
        part_bytes=(SIZE,),
        timeout_s=30,
    )


def _keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def test_a_write_asks_admission_once_and_writes_only_what_it_admits(backend) -> None:
    runner = HostRunner(backend)
    keys = _keys(4)
    first = runner.write(_request(backend, keys, _Buffers(4, 1)))
    # offered once: second-hit refuses every block; nothing written, nothing failed
    assert first.done == (False,) * 4 and first.refused == (True,) * 4
    assert first.ok and first.failure is None
    assert _plugin(backend).writes == []
    second = runner.write(_request(backend, keys, _Buffers(4, 1)))
    assert second.done == (True,) * 4 and second.refused == (False,) * 4
    assert _plugin(backend).offers == [keys, keys]  # once per write, never twice
    stats = runner.stats()
    assert stats["host.blocks_refused.write"] == 4
    assert stats["host.blocks_done.write"] == 4
    assert stats["host.jobs.write"] == 2 and stats["host.bytes.write"] == 4 * SIZE
    # a caller that asked already writes without a second offer
    third = runner.write(_request(backend, _keys(2, "x"), _Buffers(2)), admit=False)
    assert third.count == 2 and len(_plugin(backend).offers) == 2


def test_a_refused_block_costs_no_fill(backend) -> None:
    runner = HostRunner(backend)
    _plugin(backend).seen.update(["a", "b"])  # a and b were offered before; c was not
    buffers = _Buffers(3, 7)
    filled: list[int] = []

    def fill(request: BlockRequest, admitted: int) -> HostBuffers:
        filled.append(admitted)
        return buffers.host(0, admitted)

    result = runner.write(_request(backend, ["a", "b", "c"]), fill=fill)
    assert filled == [2]
    assert result.done == (True, True, False) and result.refused == (False, False, True)
    assert runner.read(_request(backend, ["a", "b"], _Buffers(2))).count == 2


def test_leading_and_per_block_answers(backend) -> None:
    runner = HostRunner(backend)
    _plugin(backend).seen.update(_keys(5))
    assert runner.write(_request(backend, _keys(5), _Buffers(5, 3))).count == 5
    runner.remove(_request(backend, ["k1"]))
    assert runner.lookup(_request(backend, _keys(5))).done == (True, False, False, False, False)
    each = runner.lookup(_request(backend, _keys(5)), each=True)
    assert each.done == (True, False, True, True, True)
    _plugin(backend).fail_on = {"k3"}
    target = _Buffers(4)
    leading = runner.read(_request(backend, ["k0", "k2", "k3", "k4"], target))
    assert leading.done == (True, True, False, False)
    assert leading.failure == "cannot read k3" and leading.outcome == 2
    per_block = runner.read(_request(backend, ["k0", "k2", "k3", "k4"], target), each=True)
    assert per_block.done == (True, True, False, True)
    assert per_block.failure == "cannot read k3"
    assert (target.data[[0, 1, 3]] == 3).all()
    stats = runner.stats()
    assert stats["host.failures.read"] == 2
    assert stats["host.blocks_failed.read"] == 2 + 1


def test_a_per_block_write_goes_on_after_a_failed_block(backend) -> None:
    runner = HostRunner(backend)
    _plugin(backend).seen.update(_keys(4))
    _plugin(backend).fail_on = {"k1"}
    result = runner.write(_request(backend, _keys(4), _Buffers(4, 9)), each=True)
    assert result.done == (True, False, True, True) and not result.ok
    assert result.handled == (True, False, True, True)
    _plugin(backend).fail_on = set()
    assert runner.lookup(_request(backend, _keys(4)), each=True).done == (True, False, True, True)


def test_jobs_run_on_the_runners_threads_and_are_polled_or_called_back(backend) -> None:
    runner = HostRunner(backend, name="t-jobs")
    _plugin(backend).seen.update(_keys(3))
    buffers = _Buffers(3, 5)
    job = runner.submit_write(
        lambda opened: _request(opened, _keys(3), buffers), blocks=3, job_id="w1", tag="mine"
    )
    assert job == "w1"
    assert runner.wait()
    (result,) = runner.get_finished()
    assert (result.job_id, result.op, result.tag, result.count) == ("w1", "write", "mine", 3)
    assert runner.get_finished() == []
    called: list[HostResult] = []
    done = threading.Event()

    def on_done(res: HostResult) -> None:
        called.append(res)
        done.set()

    target = _Buffers(3)
    runner.submit_read(_request(backend, _keys(3), target), on_done=on_done)
    assert done.wait(30)
    assert called[0].count == 3 and (target.data == 5).all()
    assert runner.get_finished() == []  # a job with a callback is answered there alone
    runner.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvcore-t-jobs")]


def test_a_full_lane_drops_a_job_at_once_and_counts_it(backend) -> None:
    plugin = _plugin(backend)
    plugin.seen.update(_keys(3))
    plugin.hold.clear()
    runner = HostRunner(backend, write_workers=1, max_queued=1)
    try:
        runner.submit_write(_request(backend, ["k0"], _Buffers(1)), job_id=1)
        assert plugin.entered.wait(30)  # job 1 holds the only thread
        runner.submit_write(_request(backend, ["k1"], _Buffers(1)), job_id=2)  # queued
        runner.submit_write(_request(backend, ["k2"], _Buffers(1)), job_id=3)  # no room
        (dropped,) = runner.get_finished()
        assert dropped.job_id == 3 and dropped.done == (False,) and "full" in dropped.failure
        assert runner.stats()["host.dropped.write"] == 1
    finally:
        plugin.hold.set()
    assert runner.wait(30)
    assert sorted(r.job_id for r in runner.get_finished()) == [1, 2]
    runner.close()


def test_a_job_still_queued_at_its_deadline_never_runs(backend) -> None:
    plugin = _plugin(backend)
    plugin.seen.update(_keys(2))
    plugin.hold.clear()
    runner = HostRunner(backend, write_workers=1)
    try:
        runner.submit_write(_request(backend, ["k0"], _Buffers(1)), job_id="first")
        assert plugin.entered.wait(30)
        submitted = time.monotonic()
        runner.submit_write(_request(backend, ["k1"], _Buffers(1)), job_id="late", timeout_s=0.01)
        while time.monotonic() < submitted + 0.02:  # until the late job's deadline has passed
            time.sleep(0.01)
    finally:
        plugin.hold.set()
    assert runner.wait(30)
    results = {r.job_id: r for r in runner.get_finished()}
    assert results["first"].count == 1
    late = results["late"]
    assert late.done == (False,) and late.kind == kvcore.FailureKind.DEADLINE
    assert plugin.writes == [["k0"]]  # the late job never reached the backend
    assert runner.stats()["host.deadline_missed.write"] == 1
    runner.close()


def test_cancel_and_close_answer_queued_jobs_without_running_them(backend) -> None:
    plugin = _plugin(backend)
    plugin.seen.update(_keys(3))
    plugin.hold.clear()
    runner = HostRunner(backend, write_workers=1, name="t-close")
    runner.submit_write(_request(backend, ["k0"], _Buffers(1)), job_id="a")
    assert plugin.entered.wait(30)
    runner.submit_write(_request(backend, ["k1"], _Buffers(1)), job_id="b")
    runner.submit_write(_request(backend, ["k2"], _Buffers(1)), job_id="c")
    assert runner.cancel("b") and not runner.cancel("b") and not runner.cancel("a")
    closer = threading.Thread(target=runner.close)
    closer.start()
    plugin.hold.set()  # the running job ends; close joins the thread after it
    closer.join(30)
    assert not closer.is_alive()
    results = {r.job_id: r for r in runner.get_finished()}
    assert results["a"].count == 1
    assert results["b"].failure == "cancelled" and results["c"].failure == "cancelled"
    assert plugin.writes == [["k0"]]
    assert runner.stats()["host.cancelled.write"] == 2
    late = runner.submit_write(_request(backend, ["k1"], _Buffers(1)))
    (answer,) = runner.get_finished()
    assert answer.job_id == late and answer.failure == "the runner is closed"
    assert not [t for t in threading.enumerate() if t.name.startswith("kvcore-t-close")]


def test_a_store_that_is_not_open_is_a_counted_miss() -> None:
    handle = kvcore.BackendHandle(_Unreachable, retry_s=3600)
    runner = HostRunner(handle)
    built: list[int] = []

    def build(opened: kvcore.Backend) -> BlockRequest:
        built.append(1)
        return _request(opened, ["a", "b"])

    result = runner.lookup(build, blocks=2)
    assert result.done == (False, False) and "not open" in result.failure
    runner.submit_read(build, blocks=2)
    assert runner.wait(30)
    (job,) = runner.get_finished()
    assert job.done == (False, False)
    assert built == []  # nothing is built for a store that is not there
    stats = runner.stats()
    assert stats["host.unavailable.lookup"] == 1 and stats["host.unavailable.read"] == 1
    assert stats["host.blocks_failed.read"] == 2
    runner.close()
    handle.close()


def test_a_request_that_cannot_be_built_or_a_raising_callback_is_counted(backend, caplog) -> None:
    runner = HostRunner(backend)

    def broken(opened: kvcore.Backend) -> BlockRequest:
        raise ValueError("chunk ids outside the pool")

    with pytest.raises(ValueError, match="chunk ids"):  # a caller's own error, to the caller
        runner.read(broken, blocks=3)
    runner.submit_read(broken, blocks=3)  # as a job: answered, counted
    got: list[HostResult] = []
    runner.submit_lookup(_request(backend, ["a"]), on_done=lambda r: 1 / 0)
    runner.submit_lookup(_request(backend, ["b"]), on_done=got.append)
    assert runner.wait(30)
    assert len(got) == 1
    (failed,) = runner.get_finished()
    assert failed.done == (False,) * 3 and "chunk ids" in failed.failure
    stats = runner.stats()
    assert stats["host.errors.read"] == 1 and stats["host.errors.lookup"] == 1
    assert "callback raised" in caplog.text
    runner.close()


def test_a_malformed_request_raises_to_its_caller_and_fails_a_job(backend) -> None:
    _plugin(backend).seen.add("a")
    short = HostBuffers(ptrs=(), nbytes=(SIZE,))  # no buffer for the request's block
    bad = backend.request("t", ["a"], host=short, parts=("obj",), part_bytes=(SIZE,))
    runner = HostRunner(backend)
    with pytest.raises(ValueError, match="host buffers hold 0 blocks"):
        runner.write(bad)
    runner.submit_write(bad)
    assert runner.wait(30)
    (result,) = runner.get_finished()
    assert result.done == (False,) and "host buffers hold 0 blocks" in result.failure
    assert runner.stats()["host.errors.write"] == 1
    runner.close()


def test_every_counter_is_of_the_vocabulary(backend) -> None:
    runner = HostRunner(backend)
    _plugin(backend).seen.update(["a"])
    runner.write(_request(backend, ["a", "b"], _Buffers(2)))
    runner.read(_request(backend, ["a"], _Buffers(1)))
    names = {key.split(".")[1] for key in runner.stats()} - {"pending"}
    names -= {"latency_count", "latency_sum_s"}
    assert names <= set(COUNTERS), names - set(COUNTERS)
