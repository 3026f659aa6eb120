"""The storage tier's KV events in SGLang's format: SGLang's own ZMQ publisher sends them, a
subscriber here (bound on 127.0.0.1, as a router's collector) decodes them with SGLang's own
msgspec types. Stored pages are named by SGLang's page-hash convention; evictions (a kv_file
store smaller than what is written) and a clear of the namespace follow."""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
import zmq
from conftest import page_indices, page_keys
from kvcore_sglang.testing import fill_random, mha_host_pool
from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from sglang.srt.mem_cache.utils import hash_str_to_int64


class Collector:
    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        self.events: list = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.bind(self.endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            self.events.extend(self._decoder.decode(frames[-1]).events)

    def wait_for(self, predicate, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


@pytest.mark.parametrize("backend_spec", ["file"], indirect=True)
def test_stored_evicted_and_cleared_pages_reach_a_router(make_storage, collector, tmp_path):
    pool = mha_host_pool("page_first")
    fill_random(pool, 5)
    probe = make_storage(pool)
    keys = page_keys(24, seed=9)
    assert probe.batch_set_v1(keys[:1], page_indices(pool, 0, 1)) == [True]
    page_file_bytes = probe.kvcore_stats()["kv.backend_bytes_used"]
    probe.clear()
    storage = make_storage(
        pool,
        extra={
            "events_endpoint": collector.endpoint,
            "backend_config": {"root": str(tmp_path / "events"),
                               "capacity_bytes": int(16.5 * page_file_bytes)},
        },
    )  # fmt: skip

    def named(kind) -> list[int]:
        return [h for e in collector.events if isinstance(e, kind) for h in e.block_hashes]

    expected = [hash_str_to_int64(k) for k in keys]
    assert storage.batch_set_v1(keys[:8], page_indices(pool, 0, 8)) == [True] * 8
    collector.wait_for(lambda: len(named(BlockStored)) >= 8)
    stored = [e for e in collector.events if isinstance(e, BlockStored)]
    assert named(BlockStored) == expected[:8]  # SGLang's names for the pages, in order
    assert {e.medium for e in stored} == {"DISK"}
    assert {e.block_size for e in stored} == {pool.page_size}

    assert storage.batch_set_v1(keys[8:], page_indices(pool, 8, 16)) == [True] * 16  # evicts
    collector.wait_for(lambda: len(named(BlockStored)) >= 24 and named(BlockRemoved))
    held = {expected[i] for i in range(24) if storage.batch_exists(keys[i : i + 1]) == 1}
    gone = set(named(BlockRemoved))
    assert gone and held.isdisjoint(gone), "a page still stored was reported removed"
    assert set(expected) - held == gone, "pages left the store without BlockRemoved"

    assert storage.clear()
    collector.wait_for(lambda: any(isinstance(e, AllBlocksCleared) for e in collector.events))
    assert any(isinstance(e, AllBlocksCleared) for e in collector.events)
    assert held <= set(named(BlockRemoved)), "pages cleared from the store, no BlockRemoved"
