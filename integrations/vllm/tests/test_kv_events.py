"""The connector's KV events on the real vLLM engine (CPU): vLLM publishes them over ZMQ on
127.0.0.1 beside the engine's own, and a subscriber here decodes them with vLLM's msgspec types.

One engine over a kv_file store smaller than what it stores: prompt A's blocks are stored
(``BlockStored`` with ``medium=STORAGE``, named by the same hashes as the engine's GPU events,
with their token ids and chained parent hashes); a second long prompt evicts some of them
(``BlockRemoved`` for exactly the blocks that left, checked against the store); a clear of
the namespace by another opener removes the rest (``BlockRemoved`` for every block left).
"""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from conftest import BLOCK_SIZE, Prompts, favour_mooncake, run_engine
from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)


class Subscriber:
    """vLLM's KV events from a ZMQ publisher, decoded with vLLM's own types.

    Bound on 127.0.0.1: vLLM's publisher connects to a ``tcp://host:port`` endpoint (it binds
    only wildcard and ipc endpoints), as to a router's collector."""

    def __init__(self, endpoint: str) -> None:
        self.events: list = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.bind(endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            batch = self._decoder.decode(payload)
            self.events.extend((batch.ts, e) for e in batch.events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


def settle_steps(name: str, tiny: list[list[int]]) -> list[dict]:
    """Steps that let the workers' saves land and vLLM publish their events: the engine
    publishes only when it steps, so it steps on prompts with no full block (nothing saved)."""
    return [
        {"op": "sleep", "seconds": 1.0},
        {"op": "generate", "name": f"{name}1", "prompts": tiny, "max_tokens": 2},
        {"op": "sleep", "seconds": 1.0},
        {"op": "generate", "name": f"{name}2", "prompts": tiny, "max_tokens": 2},
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_store_events_name_the_engines_blocks_and_follow_evictions_and_clears(
    model_dir: Path, prompts: Prompts, tmp_path: Path
) -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    sub = Subscriber(endpoint)
    rng = random.Random(7)
    other = [rng.randrange(1, 512) for _ in range(600)]  # C: evicts part of A
    tiny = [[rng.randrange(1, 512) for _ in range(8)]]  # no full block: steps, no saves
    root = str(tmp_path / "store")
    # ~20 blocks of this model fit (24 KiB each with headers): A (19) fits, A and C (38) do not
    connector = {
        "backend": "file",
        "backend_config": {"root": root, "capacity_bytes": 500_000},
        "namespace": "events",
    }

    def settle(name: str) -> list[dict]:
        return settle_steps(name, tiny)

    try:
        run = run_engine(
            {
                "model": str(model_dir),
                "connector": connector,
                "in_process": True,
                "kv_events_endpoint": endpoint,
                "steps": [
                    {"op": "generate", "name": "A", "prompts": [prompts.a], "max_tokens": 40},
                    *settle("after_a"),
                    {"op": "generate", "name": "C", "prompts": [other], "max_tokens": 40},
                    *settle("after_c"),
                    {"op": "call", "name": "held_A", "target": "engine_helpers:blocks_in_store",
                     "args": {"prompt": prompts.a}},
                    {"op": "call", "name": "held_C", "target": "engine_helpers:blocks_in_store",
                     "args": {"prompt": other}},
                    {"op": "call", "name": "clear", "target": "engine_helpers:clear_store"},
                    *settle("after_clear"),
                ],
            },
            tmp_path,
            "events",
        )  # fmt: skip
    finally:
        sub.close()
    stamped = sub.events
    events = [e for _, e in stamped]
    gpu = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_GPU]
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE]
    assert gpu and stored, f"{len(events)} events: {[type(e).__name__ for e in events][:20]}"
    assert not [e for e in events if isinstance(e, AllBlocksCleared)]

    def removed_by(when: float) -> set:
        return {
            h
            for ts, e in stamped
            if ts <= when and isinstance(e, BlockRemoved) and e.medium == MEDIUM_STORAGE
            for h in e.block_hashes
        }

    def engine_hashes(tokens: list[int]) -> dict[int, object]:
        """Block index -> the hash the engine's own GPU events give that block's tokens."""
        out = {}
        for e in gpu:
            for j, h in enumerate(e.block_hashes):
                toks = list(e.token_ids[j * BLOCK_SIZE : (j + 1) * BLOCK_SIZE])
                for i in range(len(tokens) // BLOCK_SIZE):
                    if tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE] == toks:
                        out.setdefault(i, h)
        return out

    announced = {e.block_hashes[0]: e for e in stored}
    assert all(e.block_size == BLOCK_SIZE and len(e.block_hashes) == 1 for e in stored)
    checked = 0
    for name, tokens in (("A", prompts.a), ("C", other)):
        seq = tokens + run.step(name)["tokens"][0]
        saved = (len(seq) - 1) // BLOCK_SIZE  # full blocks the connector saves
        hashes = engine_hashes(seq)
        for i in range(saved):  # every saved block: the engine's hash, its tokens, its parent
            assert hashes[i] in announced, f"block {i} of {name} never announced stored"
            e = announced[hashes[i]]
            assert list(e.token_ids) == seq[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            assert e.parent_block_hash == (hashes[i - 1] if i else None)
            checked += 1
        probe = run.step(f"held_{name}")["result"]
        left = {hashes[i] for i, held in enumerate(probe["held"][:saved]) if not held}
        kept = {hashes[i] for i, held in enumerate(probe["held"][:saved]) if held}
        gone = removed_by(probe["at"])
        assert left <= gone, f"{name}: blocks left the store without BlockRemoved"
        assert not kept & gone, f"{name}: BlockRemoved for blocks still stored"
    assert not all(run.step("held_A")["result"]["held"][:18]), "nothing of A was evicted"
    assert checked == 2 * ((600 + 40 - 1) // BLOCK_SIZE)
    # after the clear, every block announced stored and not removed before is removed
    assert set(announced) <= removed_by(float("inf")), "blocks left by the clear, no event"


def _per_block(events: list, medium: str) -> list[dict]:
    """Every ``BlockStored`` of ``medium`` as one record per block (vLLM batches blocks)."""
    out = []
    for e in events:
        if not isinstance(e, BlockStored) or e.medium != medium:
            continue
        parent = e.parent_block_hash
        for j, h in enumerate(e.block_hashes):
            extra = e.extra_keys[j] if e.extra_keys and j < len(e.extra_keys) else None
            out.append(
                {
                    "hash": h,
                    "parent": parent,
                    "tokens": list(e.token_ids[j * e.block_size : (j + 1) * e.block_size]),
                    "lora": e.lora_name,
                    "extra": tuple(extra) if extra else (),
                }
            )
            parent = h
    return out


def _router_chain(gpu: list[dict], tokens: list[int], lora: str | None, salt: str | None):
    """What a router that indexes the engine's events alone takes for a request's prefix: the
    chain of GPU blocks from the root whose tokens, adapter and extra keys (the salt on the
    first block, the adapter's name on every block, as vLLM publishes them) are the request's."""
    chain, parent = [], None
    for i in range(len(tokens) // BLOCK_SIZE):
        want = [*([lora] if lora else []), *([salt] if salt and i == 0 else [])]
        found = [
            b["hash"]
            for b in gpu
            if b["parent"] == parent
            and b["tokens"] == tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            and b["lora"] == lora
            and list(b["extra"]) == want
        ]
        if not found:
            break
        assert len(set(found)) == 1, f"block {i}: the engine's events name it {set(found)}"
        parent = found[0]
        chain.append(parent)
    return chain


def test_storage_events_place_each_block_under_its_own_requests_prefix(
    model_dir: Path, prompts: Prompts, tmp_path: Path
) -> None:
    """The same tokens served plain, under a tenant's salt and with a LoRA adapter: a router
    indexing only the engine's published events (GPU and STORAGE) finds each request's stored
    blocks under that request's own chain, and never under a variant's."""
    from identity_drivers import write_lora_adapter

    lora_dir = str(write_lora_adapter(tmp_path / "adapter", model_dir, seed=3))
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    sub = Subscriber(endpoint)
    tiny = [[5, 6, 7]]
    connector = {"backend": "file", "backend_config": {"root": str(tmp_path / "s")}}
    variants = {
        "plain": {"tokens": prompts.a},
        "salted": {"tokens": prompts.a, "cache_salt": "tenant-b"},
        "adapter": {"tokens": prompts.a, "lora": {"name": "adapter-a", "path": lora_dir}},
    }

    def settle(name: str) -> list[dict]:
        return settle_steps(name, tiny)

    steps: list[dict] = []
    for name, prompt in variants.items():
        steps += [
            {"op": "reset_prefix_cache"},
            {"op": "generate", "name": name, "prompts": [prompt], "max_tokens": 4},
            *settle(f"after-{name}"),
            {"op": "sleep", "seconds": 0.5},
            {"op": "call", "name": f"{name}-at", "target": "engine_helpers:now"},
        ]
    try:
        run = run_engine(
            {
                "model": str(model_dir),
                "connector": connector,
                "in_process": True,
                "enable_lora": True,
                "kv_events_endpoint": endpoint,
                "steps": steps,
            },
            tmp_path,
            "identity-events",
        )
    finally:
        sub.close()
    assert run.step("salted")["num_cached_tokens"] == [0]  # not plain's blocks
    assert run.step("adapter")["num_cached_tokens"] == [0]
    events = [e for _, e in sub.events]
    gpu = _per_block(events, MEDIUM_GPU)
    storage = _per_block(events, MEDIUM_STORAGE)
    saved = (600 - 1) // BLOCK_SIZE  # full prompt blocks stored (4 generated tokens: none more)
    chains = {
        name: _router_chain(
            gpu,
            prompts.a,
            (v.get("lora") or {}).get("name"),
            v.get("cache_salt"),
        )
        for name, v in variants.items()
    }
    for name, chain in chains.items():
        assert len(chain) >= saved, f"{name}: the router finds {len(chain)} GPU blocks"
    stored_by = {b["hash"]: b for b in storage}
    for name, chain in chains.items():
        mine = set(chain[:saved])
        assert mine <= set(stored_by), f"{name}: stored blocks missing under its own prefix"
        for other, other_chain in chains.items():
            if other != name:
                assert not mine & set(other_chain), f"{name} and {other} share a block hash"
        for i, h in enumerate(chain[:saved]):  # as the engine's own event says the block
            block = stored_by[h]
            assert block["parent"] == (chain[i - 1] if i else None)
            assert block["tokens"] == prompts.a[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
    assert stored_by[chains["salted"][0]]["extra"] == ("tenant-b",)
    assert stored_by[chains["adapter"][3]]["lora"] == "adapter-a"
    # before the variants ran, storage held the plain request's blocks alone
    at = run.step("plain-at")["result"]
    early = {
        h
        for ts, e in sub.events
        if ts <= at and isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE
        for h in e.block_hashes
    }
    assert early and early <= set(chains["plain"])


def test_an_engine_announces_what_it_finds_stored_and_removes_only_what_it_announced(
    model_dir: Path, prompts: Prompts, tmp_path: Path
) -> None:
    """Engine B attaches to a store another engine filled: it announces A's blocks
    ``BlockStored`` (STORAGE) from the store's listing and the blocks' descriptors before it
    serves anything, with the hashes, tokens and parents B's own GPU events give them when it
    then restores prompt A; a clear by another process then removes them, and B never sends
    ``BlockRemoved`` for a block it did not announce first."""
    root = str(tmp_path / "store")
    connector = {"backend": "file", "backend_config": {"root": root}, "namespace": "shared"}
    a = {"op": "generate", "prompts": [prompts.a], "max_tokens": 4}
    tiny = [[5, 6, 7]]
    writer = run_engine(
        {
            "model": str(model_dir),
            "connector": connector,
            "in_process": True,
            "steps": [{**a, "name": "A"}, {"op": "sleep", "seconds": 1.0}],
        },
        tmp_path,
        "events-writer",
    )
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    sub = Subscriber(endpoint)
    try:
        run = run_engine(
            {
                "model": str(model_dir),
                "connector": connector,
                "in_process": True,
                "kv_events_endpoint": endpoint,
                "steps": [
                    {"op": "sleep", "seconds": 2.0},  # idle: attached, announcing
                    {"op": "call", "name": "before_serve", "target": "engine_helpers:now"},
                    {**a, "name": "A"},
                    *settle_steps("after_a", tiny),
                    {"op": "call", "name": "clear", "target": "engine_helpers:clear_store"},
                    *settle_steps("after_clear", tiny),
                ],
            },
            tmp_path,
            "events-reader",
        )
    finally:
        sub.close()
    saved = (600 - 1) // BLOCK_SIZE
    assert run.step("A")["num_cached_tokens"] == [saved * BLOCK_SIZE]
    assert run.step("A")["tokens"] == writer.step("A")["tokens"]
    events = [e for _, e in sub.events]
    chain = _router_chain(_per_block(events, MEDIUM_GPU), prompts.a, None, None)
    assert len(chain) >= saved
    storage = {b["hash"]: b for b in _per_block(events, MEDIUM_STORAGE)}
    before = run.step("before_serve")["result"]
    attached = {
        h for ts, e in sub.events
        if ts <= before and isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE
        for h in e.block_hashes
    }  # fmt: skip
    for i, h in enumerate(chain[:saved]):  # every restored block, as B's GPU events name it
        assert h in attached, f"block {i} stored before B started, not announced at attach"
        assert storage[h]["parent"] == (chain[i - 1] if i else None)
        assert storage[h]["tokens"] == prompts.a[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
    announced: set = set()
    removed: set = set()
    for e in events:
        if isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE:
            announced.update(e.block_hashes)
        elif isinstance(e, BlockRemoved) and e.medium == MEDIUM_STORAGE:
            unannounced = set(e.block_hashes) - announced
            assert not unannounced, f"BlockRemoved for {len(unannounced)} unannounced blocks"
            removed.update(e.block_hashes)
    assert set(chain[:saved]) <= removed, "the clear removed A's blocks without an event"


class RouterIndex:
    """What a KV-aware router knows from events alone: which engines hold each block, by
    medium, built from every engine's published events (as Dynamo's and llm-d's indexers)."""

    def __init__(self) -> None:
        self.holders: dict[tuple[object, str], set[str]] = {}
        self.announced: dict[str, set] = {}
        self.unannounced_removals: list[tuple[str, object]] = []

    def apply(self, engine: str, event: object) -> None:
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                self.holders.setdefault((h, event.medium), set()).add(engine)
                if event.medium == MEDIUM_STORAGE:
                    self.announced.setdefault(engine, set()).add(h)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self.holders.get((h, event.medium), set()).discard(engine)
                if event.medium == MEDIUM_STORAGE and h not in self.announced.get(engine, ()):
                    self.unannounced_removals.append((engine, h))
        elif isinstance(event, AllBlocksCleared):
            for engines in self.holders.values():
                engines.discard(engine)

    def credited(self, engine: str, chain: list, medium: str = MEDIUM_STORAGE) -> int:
        """Leading blocks of ``chain`` the router credits ``engine`` with on ``medium``."""
        n = 0
        for h in chain:
            if engine not in self.holders.get((h, medium), ()):
                break
            n += 1
        return n


def _index_until(subs: dict[str, Subscriber], until: float) -> RouterIndex:
    index = RouterIndex()
    merged = sorted(
        ((ts, engine, e) for engine, sub in subs.items() for ts, e in list(sub.events)
         if ts <= until),
        key=lambda record: record[0],
    )  # fmt: skip
    for _, engine, e in merged:
        index.apply(engine, e)
    return index


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_every_engine_on_a_shared_store_is_credited_with_its_blocks_in_real_time(
    model_dir: Path, prompts: Prompts, tmp_path: Path, backend: str
) -> None:
    """Two engines over one shared store (one kv_file root; one Mooncake cluster, a real
    ``mooncake_master`` on 127.0.0.1), each publishing to a router's subscriber. Engine A
    serves prompt A; engine B, idle, is credited with every block A stored before B serves
    the prompt (from the blocks' own descriptors: B never computed them). B then serves it
    from the store. A third process clears the namespace: both engines, idle, remove every
    block they announced within the configured delay, and never one they did not announce."""
    if backend == "file":
        _shared_store_credits(model_dir, prompts, tmp_path, "file", {"root": str(tmp_path / "s")})
        return
    from kv_mooncake.testing import MooncakeCluster

    with MooncakeCluster(storage_bytes=256 << 20) as cluster:
        # the store lists itself every watch_interval_s: a change reaches the engines' streams
        # within that, and their routers within events_interval_s more
        config = {**favour_mooncake(cluster), "watch_interval_s": 0.5}
        _shared_store_credits(model_dir, prompts, tmp_path, "mooncake", config, store_delay=0.5)


def _shared_store_credits(
    model_dir: Path,
    prompts: Prompts,
    tmp_path: Path,
    backend: str,
    backend_config: dict,
    store_delay: float = 0.0,
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import kvcore

    interval = 0.5
    connector = {
        "backend": backend,
        "backend_config": backend_config,
        "namespace": "shared",
        "events_interval_s": interval,
    }
    signal = {name: str(tmp_path / name) for name in ("a_stored", "b_served", "cleared")}
    a = {"op": "generate", "name": "A", "prompts": [prompts.a], "max_tokens": 4}

    def call(name: str, target: str, **args: object) -> dict:
        return {"op": "call", "name": name, "target": f"engine_helpers:{target}", "args": args}

    idle = 3 * interval + 1.0  # both engines stay idle this long after the clear
    steps = {
        "A": [
            call("ready", "now"),
            a,
            {"op": "sleep", "seconds": 1.0},  # the workers' saves land
            call("stored", "touch", path=signal["a_stored"]),
            call("wait_clear", "wait_for_file", path=signal["cleared"]),
            {"op": "sleep", "seconds": idle},
        ],
        "B": [
            call("ready", "now"),
            call("wait_a", "wait_for_file", path=signal["a_stored"]),
            {"op": "sleep", "seconds": 2 * interval + 0.5},  # idle: the follower's rounds
            call("before_serve", "now"),
            a,
            {"op": "sleep", "seconds": 1.0},
            call("served", "touch", path=signal["b_served"]),
            call("wait_clear", "wait_for_file", path=signal["cleared"]),
            {"op": "sleep", "seconds": idle},
        ],
    }
    endpoints = {name: f"tcp://127.0.0.1:{_free_port()}" for name in steps}
    subs = {name: Subscriber(endpoint) for name, endpoint in endpoints.items()}

    def engine(name: str):
        spec = {
            "model": str(model_dir),
            "connector": connector,
            "in_process": True,
            "kv_events_endpoint": endpoints[name],
            "steps": steps[name],
        }
        return run_engine(spec, tmp_path, f"shared-{name}")

    def third_process_clears() -> float:
        """The operator's clear, from this (the test's) process, once B has served."""
        deadline = time.monotonic() + 900
        while not Path(signal["b_served"]).exists():
            if time.monotonic() > deadline:
                raise TimeoutError("engine B never served")
            time.sleep(0.05)
        context = kvcore.BackendContext(namespace="shared")
        with kvcore.open_backend(backend, backend_config, context=context) as store:
            at = time.time()
            assert int(store.clear()) > 0
        Path(signal["cleared"]).touch()
        return at

    try:
        with ThreadPoolExecutor(3) as pool:
            runs = {name: pool.submit(engine, name) for name in steps}
            cleared_at = pool.submit(third_process_clears).result(timeout=1200)
            run = {name: fut.result(timeout=1200) for name, fut in runs.items()}
    finally:
        for sub in subs.values():
            sub.close()

    saved = (600 - 1) // BLOCK_SIZE
    # B served A's prompt from the store, with A's tokens
    assert run["B"].step("A")["num_cached_tokens"] == [saved * BLOCK_SIZE]
    assert run["B"].step("A")["tokens"] == run["A"].step("A")["tokens"]
    a_events = [e for _, e in subs["A"].events]
    chain = _router_chain(_per_block(a_events, MEDIUM_GPU), prompts.a, None, None)
    assert len(chain) >= saved
    # before B serves the prompt, the router credits B with every block A stored
    before = run["B"].step("before_serve")["result"]
    index = _index_until(subs, before)
    assert index.credited("A", chain) == saved, "A's own saves were not announced"
    assert index.credited("B", chain) == saved, (
        f"B credited with {index.credited('B', chain)} of the {saved} blocks A stored"
    )
    b_before = {
        h for ts, e in subs["B"].events
        if ts <= before and isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE
        for h in e.block_hashes
    }  # fmt: skip
    a_at = max(ts for ts, e in subs["A"].events if isinstance(e, BlockStored)
               and e.medium == MEDIUM_STORAGE and e.block_hashes[0] in chain)  # fmt: skip
    b_at = max(ts for ts, e in subs["B"].events if isinstance(e, BlockStored)
               and e.medium == MEDIUM_STORAGE and e.block_hashes[0] in chain)  # fmt: skip
    print(f"B announced A's blocks {b_at - a_at:.3f} s after A did")
    # B's announcements carry what A's do: parent and tokens, block by block
    storage_b = {b["hash"]: b for b in _per_block([e for _, e in subs["B"].events], MEDIUM_STORAGE)}
    for i, h in enumerate(chain[:saved]):
        assert h in b_before
        assert storage_b[h]["parent"] == (chain[i - 1] if i else None)
        assert storage_b[h]["tokens"] == prompts.a[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
    # the clear: both engines, idle, drop every block they announced within the delay
    for name in ("A", "B"):
        removals = [
            (ts, h) for ts, e in subs[name].events
            if isinstance(e, BlockRemoved) and e.medium == MEDIUM_STORAGE and ts >= cleared_at
            for h in e.block_hashes
        ]  # fmt: skip
        assert set(chain[:saved]) <= {h for _, h in removals}, f"{name}: blocks left silently"
        late = max(ts for ts, _ in removals) - cleared_at
        print(f"{name}: the clear's removals published {late:.3f} s after it")
        # the configured delays (kv_file's own follower: 50 ms), plus this loaded machine
        bound = interval + store_delay + 1.0
        assert late <= bound, f"{name}: removals published {late:.2f} s after the clear"
    final = _index_until(subs, float("inf"))
    assert not final.unannounced_removals, final.unannounced_removals[:5]
    assert final.credited("A", chain) == final.credited("B", chain) == 0
