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
                               # 16.5 pages, and room for the store's ledger and journal
                               "capacity_bytes": int(16.5 * page_file_bytes) + (28 << 10)},
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


class TokenRouter:
    """A router index that places pages by hashing their token ids itself, as Dynamo's and
    llm-d's indexers do: a page's own id is a hash of its parent's own id and its tokens; the
    published hashes only link a page to its parent. A page published without tokens, or
    whose parent it never placed, cannot be placed."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._own: dict[int, bytes] = {}  # published hash -> own id
        self.placed: set[bytes] = set()
        self.unplaceable = 0

    @staticmethod
    def own_id(parent: bytes, tokens: list[int]) -> bytes:
        import hashlib

        return hashlib.blake2b(parent + repr(tokens).encode(), digest_size=16).digest()

    def apply(self, event: BlockStored) -> None:
        if not event.token_ids:
            self.unplaceable += len(event.block_hashes)
            return
        parent = (
            b"root" if event.parent_block_hash is None else self._own.get(event.parent_block_hash)
        )
        for i, published in enumerate(event.block_hashes):
            tokens = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
            if parent is None or len(tokens) != event.block_size:
                self.unplaceable += 1
                return
            parent = self.own_id(parent, list(tokens))
            self._own[published] = parent
            self.placed.add(parent)

    def hit_pages(self, prompt: list[int]) -> int:
        """Leading full pages of ``prompt`` placed in the store."""
        own, n = b"root", 0
        for start in range(0, len(prompt) - self.page_size + 1, self.page_size):
            own = self.own_id(own, prompt[start : start + self.page_size])
            if own not in self.placed:
                break
            n += 1
        return n


@pytest.mark.parametrize("backend_spec", ["file", "mooncake"], indirect=True)
def test_a_router_that_hashes_tokens_places_pages_another_process_stored(
    make_storage, collector, backend_spec
):
    """Storage A backs pages up through SGLang's own backup path (``_page_backup``, two
    operations of one sequence, the second with the first's keys as ``prefix_keys``); storage
    B, on the same store (a kv_file root; a Mooncake cluster), publishes them with their token ids and parents, read from
    the pages themselves, and a router that hashes tokens itself places every page. Pages
    whose tokens do not hash to their key, and a cache-salt's pages, are published without
    tokens: never placed, never credited to the plain prompt. A third storage attaching later
    announces the pages it finds stored, tokens included."""
    from kvcore_sglang.testing import controller_for
    from sglang.srt.managers.cache_controller import StorageOperation
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    pool = mha_host_pool("page_first", pages=64)
    fill_random(pool, 11)
    writer = make_storage(pool)
    make_storage(pool, extra={"events_endpoint": collector.endpoint})  # B: publishes
    ctrl = controller_for(writer, pool, zero_copy=True)
    ps = pool.page_size
    prompt = [(31 * i + 7) % 50_000 for i in range(20 * ps)]
    keys = get_storage_hash_str(prompt, None, page_size=ps)
    first = StorageOperation(page_indices(pool, 0, 12), prompt[: 12 * ps], hash_value=keys[:12])
    ctrl._page_backup(first)
    rest = StorageOperation(
        page_indices(pool, 12, 8), prompt[12 * ps :], hash_value=keys[12:], prefix_keys=keys[:12]
    )
    ctrl._page_backup(rest)
    assert first.completed_tokens + rest.completed_tokens == len(prompt)
    # a tenant's pages (same tokens, salted chain), and pages whose tokens lie about their keys
    salted = RadixKey(prompt[: 4 * ps], cache_salt="tenant-b")
    salted_keys = get_storage_hash_str(salted, None, page_size=ps)
    ctrl._page_backup(StorageOperation(page_indices(pool, 20, 4), salted, hash_value=salted_keys))
    other = [t + 1 for t in prompt[: 3 * ps]]
    lying = get_storage_hash_str(other, None, page_size=ps)
    ctrl._page_backup(
        StorageOperation(page_indices(pool, 24, 3), prompt[: 3 * ps], hash_value=lying)
    )

    def stored() -> list[BlockStored]:
        return [e for e in collector.events if isinstance(e, BlockStored)]

    collector.wait_for(lambda: sum(len(e.block_hashes) for e in stored()) >= 27)
    router = TokenRouter(ps)
    for event in stored():
        router.apply(event)
    assert router.hit_pages(prompt) == 20, "the router could not place the pages B announced"
    by_hash = {e.block_hashes[0]: e for e in stored() if e.token_ids}
    for i, key in enumerate(keys):  # SGLang's names, parents and tokens, page by page
        event = by_hash[hash_str_to_int64(key)]
        assert event.token_ids == prompt[i * ps : (i + 1) * ps]
        assert event.parent_block_hash == (hash_str_to_int64(keys[i - 1]) if i else None)
    bare = {h for e in stored() if not e.token_ids for h in e.block_hashes}
    assert {hash_str_to_int64(k) for k in salted_keys + lying} <= bare
    assert router.unplaceable == 7
    assert router.hit_pages(other) == 0
    # a storage attaching to the filled store announces what it finds, tokens and parents
    late = Collector()
    try:
        make_storage(pool, extra={"events_endpoint": late.endpoint})
        late.wait_for(lambda: sum(len(e.block_hashes) for e in late.events) >= 27)
        attached = TokenRouter(ps)
        for event in late.events:
            attached.apply(event)
        assert attached.hit_pages(prompt) == 20, "an attaching storage did not announce the store"
    finally:
        late.close()
