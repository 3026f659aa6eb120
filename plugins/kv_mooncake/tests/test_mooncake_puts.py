"""Waiting for a put takes no engine core: the client polls a transfer until it ends
(:mod:`kv_mooncake.puts`), so every put is made from a thread at the lowest CPU priority."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
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


def test_every_put_waits_on_a_background_thread_and_every_read_on_its_callers(
    mooncake_cluster_factory: Callable[..., MooncakeCluster],
) -> None:
    """Before, the kvcore thread that wrote made the put itself and polled it at the engine's
    priority: on vLLM's CPU engine (2 cores) behind a 490 Mbit/s link, a prompt computed while
    the blocks of the one before were stored took 0.52-0.57 s to its first token, against
    0.30 s. Blocks with metadata, so the companions' puts are made the same way. Reads stay on
    the caller's thread, at its priority: a request waits for them."""
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
        done, got = h.read(seq)
        assert done == 6
        assert blocks_equal(got, h.payload(seq, 0, 6)) == []
        puts = [c for c in spy.calls if c[0] in PUTS]
        reads = [c for c in spy.calls if c[0] in READS]
        assert {c[0] for c in puts} == {"batch_upsert_from", "upsert_batch"}, spy.calls
        assert all(tid != caller and nice == BACKGROUND_NICE for _, tid, nice in puts), puts
        assert reads and all(tid == caller and nice == caller_nice for _, tid, nice in reads)
        assert os.getpriority(os.PRIO_PROCESS, caller) == caller_nice
    finally:
        backend.plugin._store = spy._store
        backend.close()
