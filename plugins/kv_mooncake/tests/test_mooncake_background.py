"""Waiting for a put takes no engine core: the client polls a transfer until it ends
(:mod:`kv_mooncake.background`), so every put is made from a thread at the lowest CPU
priority, and so is every read a caller waits for idle (``BlockRequest.caller_idle``); other
reads are polled by their caller."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
from kv_mooncake.testing import MooncakeCluster

import kvcore
from kvcore.testing import Harness, blocks_equal, small_layout
from kvcore.threads import BACKGROUND_NICE

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's"
)

PUTS = ("batch_upsert_from", "batch_put_from_multi_buffers", "upsert_batch")
READS = ("batch_get_into", "batch_get_into_multi_buffers")


class _CallingThreads:
    """Delegates to the real client and records, for each put and read, the thread that
    made it and that thread's nice value."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()
        self.calls: list[tuple[str, int, int]] = []  # (call, thread id, nice)

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._store, name)
        if name not in PUTS + READS:
            return call

        def recorded(*args: Any, **kwargs: Any) -> Any:
            tid = threading.get_native_id()
            with self._lock:
                self.calls.append((name, tid, os.getpriority(os.PRIO_PROCESS, tid)))
            return call(*args, **kwargs)

        return recorded


def test_every_put_and_every_idle_read_waits_on_a_background_thread_and_other_reads_on_theirs(
    mooncake_cluster_factory: Callable[..., MooncakeCluster],
) -> None:
    """Before, the kvcore thread that wrote made the put itself and polled it at the engine's
    priority: on vLLM's CPU engine (2 cores) behind a 490 Mbit/s link, a prompt computed while
    the blocks of the one before were stored took 0.52-0.57 s to its first token, against
    0.30 s. Blocks with metadata, so the companions' puts are made the same way. A read the
    caller waits for idle is polled from a lowest-priority thread of its own (a paced load of
    about 20 calls at 4 Gbit/s: as fast as one call, where polled by the caller it was not);
    any other read stays on the caller's thread, at its priority: the engine may be computing,
    and a lowest-priority poller would wait for it."""
    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    layout = small_layout()
    backend = kvcore.open_backend("mooncake", cluster.config(), context={"layout": layout})
    spy = _CallingThreads(backend.plugin._store)
    backend.plugin._store = spy
    h = Harness(backend, layout)
    caller = threading.get_native_id()
    caller_nice = os.getpriority(os.PRIO_PROCESS, caller)
    try:
        seq = h.new_sequence(6)
        assert int(h.write(seq, block_meta=[b"block %d" % i for i in range(6)])) == 6
        puts = [c for c in spy.calls if c[0] in PUTS]
        assert {c[0] for c in puts} == {"batch_upsert_from", "upsert_batch"}, spy.calls
        assert all(tid != caller and nice == BACKGROUND_NICE for _, tid, nice in puts), puts
        for idle in (False, True):
            spy.calls.clear()
            request, got = h.read_request(seq)
            assert backend.read(replace(request, caller_idle=idle)) == 6
            assert blocks_equal(got(), h.payload(seq, 0, 6)) == []
            reads = [c for c in spy.calls if c[0] in READS]
            assert reads, spy.calls
            if idle:  # the blocks' digests (kvcore.integrity) and their data
                assert all(tid != caller and nice == BACKGROUND_NICE for _, tid, nice in reads)
                assert backend.stats()["backend_reads_polled_in_background"] == len(reads)
            else:
                assert all(tid == caller and nice == caller_nice for _, tid, nice in reads)
        assert os.getpriority(os.PRIO_PROCESS, caller) == caller_nice
    finally:
        backend.plugin._store = spy._store
        backend.close()


@contextmanager
def _busy_cores(n: int) -> Iterator[None]:
    """``n`` processes that compute without pause at normal priority, as an engine does."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def test_a_read_marked_idle_while_every_core_computes_still_reads_every_byte(
    mooncake_cluster_factory: Callable[..., MooncakeCluster],
) -> None:
    """A caller that marks a read idle wrongly (the engine computes on every core) makes it
    slow, never wrong nor lost: the lowest-priority poller still gets its share of a core
    (251 ms against 7.7 ms for eight blocks, measured on 2 cores), and the bytes are the
    ones stored. No time is asserted: only that it ends, whole."""
    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    layout = small_layout()
    backend = kvcore.open_backend("mooncake", cluster.config(), context={"layout": layout})
    h = Harness(backend, layout)
    try:
        seq = h.new_sequence(8)
        assert int(h.write(seq)) == 8
        with _busy_cores(os.cpu_count() or 2):
            for _ in range(3):
                before = backend.stats().get("backend_reads_polled_in_background", 0.0)
                request, got = h.read_request(seq, timeout_s=120.0)
                assert backend.read(replace(request, caller_idle=True)) == 8
                assert blocks_equal(got(), h.payload(seq, 0, 8)) == []
                assert backend.stats()["backend_reads_polled_in_background"] > before
    finally:
        backend.close()
