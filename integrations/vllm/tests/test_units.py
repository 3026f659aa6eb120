"""The connector's parts on vLLM's real config and cache objects, without running an engine.

Settings errors, key determinism across processes, the mapping of vLLM's KV tensors onto
kvcore's DeviceCache (bytes moved through a real TransferManager and compared), refusals of
caches the connector cannot store, and the worker's save bookkeeping against a real
Mooncake master that is paused (a save in flight holds its request's blocks).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import BLOCK_SIZE
from kvcore_vllm.backends import connector_handle
from kvcore_vllm.config import ConnectorSettings, SettingsError, load_settings
from kvcore_vllm.keys import RequestKeys, engine_block_keys, engine_object_names, key_scope
from kvcore_vllm.layout import (
    FORM_JOINED,
    FORM_SPLIT,
    UnsupportedCacheError,
    cache_layout,
    map_layer_tensors,
    replicated_across_tp,
)
from kvcore_vllm.metadata import BlockRun, StepMetadata

import kvcore
from kvcore.keys import ScopedKeys
from kvcore.memory_backend import MemoryBackend
from kvcore.transfer import DeviceCache, TransferManager

NUM_BLOCKS = 64
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


# -- settings ------------------------------------------------------------------------------


def test_settings_name_the_bad_key() -> None:
    with pytest.raises(SettingsError, match=r"kv_connector_extra_config\.backend: Field required"):
        load_settings({})
    with pytest.raises(SettingsError, match=r"kv_connector_extra_config\.backedn"):
        load_settings({"backend": "file", "backedn": "file"})
    with pytest.raises(SettingsError, match=r"kv_connector_extra_config\.load_timeout_s"):
        load_settings({"backend": "file", "load_timeout_s": -1})
    assert load_settings({"backend": "file"}).load_failure_policy == "recompute"


def test_unknown_backend_is_an_error_not_a_dead_backend() -> None:
    context = kvcore.BackendContext(namespace="t")
    with pytest.raises(kvcore.UnknownBackendError, match="nope"):
        connector_handle("nope", {}, context, retry_s=30).get()


class _Unreachable(MemoryBackend):
    """A backend whose server is down: opening it fails (not a settings error)."""

    def __init__(self, config, context) -> None:
        raise ConnectionRefusedError("the store's server is not there")


def test_backend_that_cannot_open_is_retried_not_raised(tmp_path: Path) -> None:
    handle = connector_handle(_Unreachable, {}, kvcore.BackendContext(), retry_s=0)
    assert handle.get() is None
    assert handle.open_failures == 1
    assert handle.get() is None  # retry_s=0: never tried again
    assert handle.open_failures == 1


def test_a_root_that_cannot_hold_a_store_is_a_settings_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    handle = connector_handle("file", {"root": str(not_a_dir)}, kvcore.BackendContext(), retry_s=0)
    with pytest.raises(kvcore.ConfigError, match=r"root: .* is a regular file"):
        handle.get()  # raised at start-up: retrying cannot fix a setting


# -- keys ----------------------------------------------------------------------------------

_KEYS_SCRIPT = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from kvcore_vllm.keys import engine_block_keys
args = EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, block_size=32, max_model_len=2048,
    kv_transfer_config={"kv_connector": "KVCoreConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"backend": "memory", "namespace": "n"}})
config = args.create_engine_config()
print("KEYS " + json.dumps([engine_block_keys(config, list(range(1, 200)), cache_salt=salt)
                            for salt in (None, "tenant-a")]))
"""


def test_keys_are_the_same_in_fresh_processes(model_dir: Path) -> None:
    """vLLM's block hashes (sha256, vLLM's fixed seed) name a block alike in every process,
    whatever Python's own hash seed; a salt gives every block another key."""
    import json

    outputs = []
    for _ in range(2):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        proc = subprocess.run(
            [sys.executable, "-c", _KEYS_SCRIPT, str(model_dir)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        line = [x for x in proc.stdout.splitlines() if x.startswith("KEYS ")][-1]
        outputs.append(json.loads(line[5:]))
    assert outputs[0] == outputs[1]
    plain, salted = outputs[0]
    assert len(plain) == 6 and set(plain).isdisjoint(salted)


def test_a_block_is_named_by_the_hash_at_its_last_boundary() -> None:
    """With vLLM hashing at 16 tokens and blocks of 32, block i is keyed by hash 2i + 1 (that
    hash covers the whole prefix), as vLLM's BlockHashListWithBlockSize names it."""

    class _Req:
        request_id = "r"
        block_hashes = [bytes([i]) * 32 for i in range(7)]

    keys = RequestKeys(kvcore.KeyScope(model="m"), 32, 16)
    assert keys.blocks_keyed(_Req) == 3
    got = keys.keys(_Req, 0, 3)
    assert [keys.block_hash(k) for k in got] == [bytes([i]) * 32 for i in (1, 3, 5)]
    other = RequestKeys(kvcore.KeyScope(model="m", namespace="other"), 32, 16)
    assert set(other.keys(_Req, 0, 3)).isdisjoint(got)
    assert other.block_hash(got[0]) is None  # another scope's key names no block here
    with pytest.raises(ValueError, match="4 blocks asked, vLLM hashed 3"):
        keys.keys(_Req, 0, 4)


@pytest.fixture(scope="module")
def vllm_config(model_dir: Path) -> Any:
    """A real VllmConfig for the tiny model with the connector selected (no engine started)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        kv_transfer_config={
            "kv_connector": "KVCoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"backend": "memory", "namespace": "units"},
        },
    )
    return args.create_engine_config()


def test_scope_names_model_dtype_block_size_and_namespace(vllm_config: Any) -> None:
    settings = ConnectorSettings(backend="memory", namespace="units")
    layout = cache_layout(_kv_cache_config())
    scope = key_scope(vllm_config, settings, layout)
    assert scope.model == str(vllm_config.model_config.model)
    assert scope.namespace == "units"
    assert scope.extra["kv_dtype"] == "bfloat16"
    assert scope.extra["block_size"] == str(BLOCK_SIZE)
    assert scope.extra["engine"].startswith("vllm-0.")
    named = key_scope(vllm_config, settings.model_copy(update={"model_id": "llama-x"}), layout)
    assert named.model == "llama-x"
    # names a tool computes from the config alone are the connector's (rank and TP in them)
    names = engine_object_names(vllm_config, list(range(1, 100)))
    assert len(names) == 3 and names[0][0].endswith("/k/r0of1") and names[0][1].endswith("/v/r0of1")
    # the per-head layout: its own keys (an engine of the per-rank layout never reads them)
    per_head = settings.model_copy(update={"object_layout": "per_head"})
    head_scope = key_scope(vllm_config, per_head, cache_layout(_kv_cache_config(), per_head=True))
    assert head_scope.extra["object_layout"] == "per_head" and "object_layout" not in scope.extra
    assert ScopedKeys(head_scope).prefix != ScopedKeys(scope).prefix


# -- the cache layout ----------------------------------------------------------------------


def _kv_cache_config(
    spec: Any = None, num_blocks: int = NUM_BLOCKS, layers: list[str] = LAYERS
) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = spec or FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(layers), kv_cache_spec=spec)],
    )


def _joined_tensor() -> torch.Tensor:
    """vLLM's CPU attention cache: [blocks, heads, block_size, K then V of head_size each]."""
    return torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, 2 * 32).to(torch.bfloat16)


def _split_tensor() -> torch.Tensor:
    """FlashAttention's form: [K or V, blocks, block_size, heads, head_size]."""
    return torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, 32).to(torch.bfloat16)


def _mla_tensor() -> torch.Tensor:
    """vLLM's MLA cache: [blocks, block_size, latent] (the latent: kv_lora_rank + rope dims)."""
    return torch.randn(NUM_BLOCKS, BLOCK_SIZE, MLA_LATENT).to(torch.bfloat16)


MLA_LATENT = 576  # DeepSeek's 512 + 64


def _mla_spec(**changes: Any) -> Any:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    fields = {"block_size": BLOCK_SIZE, "num_kv_heads": 1, "head_size": MLA_LATENT}
    return MLAAttentionSpec(**{**fields, **changes}, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("make", "form", "num_layers"),
    [
        (_joined_tensor, FORM_JOINED, 2),
        (_joined_tensor, FORM_JOINED, 3),  # odd: each layer's block split in two
        (_split_tensor, FORM_SPLIT, 2),
        (_mla_tensor, FORM_JOINED, 2),  # a latent as two halves (kvcore_vllm.layout)
        (_mla_tensor, FORM_JOINED, 3),
    ],
)
def test_blocks_round_trip_through_kvcore_without_copies(
    make: Any, form: str, num_layers: int
) -> None:
    """Blocks 3 and 5 of one cache, written through kvcore and read into blocks 7 and 9 of
    another, arrive byte for byte; no other block of either cache changes."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    spec = _mla_spec() if make is _mla_tensor else None
    layout = cache_layout(_kv_cache_config(spec, layers=layers))
    if spec is not None:
        assert (layout.num_heads, layout.head_dim) == (1, MLA_LATENT // 2)
        assert replicated_across_tp(_kv_cache_config(spec, layers=layers))
    src = {name: make() for name in layers}
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    before = {name: t.clone() for name, t in src.items()}
    block = (lambda t, b: t[b]) if form == FORM_JOINED else (lambda t, b: t[:, b])
    m_src = map_layer_tensors(src, layers, layout, NUM_BLOCKS)
    m_dst = map_layer_tensors(dst, layers, layout, NUM_BLOCKS)
    assert m_src.kv_format == form
    # views over vLLM's memory, not copies
    assert m_src.k[0].data_ptr() == src[LAYERS[0]].data_ptr()
    if form == FORM_JOINED and num_layers % 2 == 0:  # halves of the layer list
        assert (m_src.id_scale, m_src.layout.num_layers) == (1, num_layers // 2)
        assert len(m_src.k) == len(m_src.v) == num_layers // 2
    elif form == FORM_JOINED:  # halves of each layer's block, kvcore block 2b for vLLM's b
        assert (m_src.id_scale, m_src.layout) == (2, layout)
    assert m_src.layout.stores_like(layout)
    # the backend is opened with the scheduler's layout, as the connector's backends are
    backend = kvcore.open_backend("memory", {}, context={"layout": layout})
    config = {"layout": m_src.layout, "max_model_len": 2048}
    keys = ["a" * 64, "b" * 64]
    with TransferManager(config, DeviceCache(m_src.layout, m_src.k, m_src.v), backend) as tm:
        ids = m_src.to_kvcore([3, 5])
        result = tm.write_back({"task_id": "w", "keys": keys, "device_block_ids": ids}).result()
        assert result.num_blocks == 2
    with TransferManager(config, DeviceCache(m_dst.layout, m_dst.k, m_dst.v), backend) as tm:
        ids = m_dst.to_kvcore([7, 9])
        result = tm.read({"task_id": "r", "keys": keys, "device_block_ids": ids}).result()
        assert result.num_blocks == 2
    backend.close()
    for name in layers:
        assert torch.equal(block(dst[name], 7), block(src[name], 3))
        assert torch.equal(block(dst[name], 9), block(src[name], 5))
        untouched = [b for b in range(NUM_BLOCKS) if b not in (7, 9)]
        assert all(not block(dst[name], b).any() for b in untouched)
        assert torch.equal(src[name], before[name])


def test_refuses_what_it_cannot_store() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    assert not replicated_across_tp(_kv_cache_config())
    for odd_latent, field in ((_mla_spec(head_size=575), "odd head_size"),
                              (_mla_spec(num_kv_heads=2), "num_kv_heads")):  # fmt: skip
        with pytest.raises(UnsupportedCacheError, match=f"MLA KV cache spec has .*{field}"):
            cache_layout(_kv_cache_config(odd_latent))
    fp32 = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32
    )
    with pytest.raises(UnsupportedCacheError, match=r"float32 has no kvcore CacheDType"):
        cache_layout(_kv_cache_config(fp32))
    layout = cache_layout(_kv_cache_config())
    odd = {
        name: torch.zeros(NUM_BLOCKS, 3, BLOCK_SIZE, 32, dtype=torch.bfloat16) for name in LAYERS
    }
    with pytest.raises(UnsupportedCacheError, match=r"layer 'model\.layers\.0\.self_attn\.attn'"):
        map_layer_tensors(odd, LAYERS, layout, NUM_BLOCKS)
    strided = {name: _joined_tensor()[::2] for name in LAYERS}
    with pytest.raises(UnsupportedCacheError, match="cannot find 64 blocks"):
        map_layer_tensors(strided, LAYERS, layout, NUM_BLOCKS)


# -- the worker's save bookkeeping -----------------------------------------------------------


def test_a_save_in_flight_holds_its_request(
    vllm_config: Any, mooncake_cluster_factory: Any
) -> None:
    """vLLM may free a finished request's blocks only once its saves are answered: with the
    Mooncake master paused, the save cannot finish and get_finished must not report it."""
    from kvcore_vllm.worker import WorkerSide

    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    settings = ConnectorSettings(
        backend="mooncake",
        backend_config=cluster.config(close_timeout_s=2.0),
        namespace="units",
        save_timeout_s=60.0,
    )
    worker = WorkerSide(vllm_config, _kv_cache_config(), settings, rank=0)
    worker.register_kv_caches({name: _joined_tensor() for name in LAYERS})
    keys = engine_block_keys(vllm_config, list(range(1, 200)))[:4]
    save = StepMetadata(saves=[BlockRun("req-1", 0, keys, [4, 5, 6, 7])])
    try:
        cluster.master.pause()
        worker.wait_for_save(save)
        assert worker.get_finished({"req-1"}) == (None, None)
        assert worker.get_finished(set()) == (None, None)
    finally:
        cluster.master.resume()
    worker.handle_preemptions(StepMetadata(preempted={"req-1"}))  # waits for the save
    deadline = time.monotonic() + 60
    finished = None
    while finished is None and time.monotonic() < deadline:
        finished, _ = worker.get_finished(set())
        time.sleep(0.05)
    assert finished == {"req-1"}
    # reported once: vLLM frees the blocks exactly once
    assert worker.get_finished(set()) == (None, None)
    stats = worker.take_stats()
    assert stats["save_blocks"] == 4
    worker.close()


def _worker_with_three_blocks_saved(
    vllm_config: Any, namespace: str
) -> tuple[Any, dict[str, torch.Tensor], list[str]]:
    """A sync-load worker over the memory backend whose device blocks 2-4 were saved: the
    worker, its caches and the three blocks' keys."""
    from kvcore_vllm.worker import WorkerSide

    settings = ConnectorSettings(backend="memory", namespace=namespace, load_mode="sync")
    worker = WorkerSide(vllm_config, _kv_cache_config(), settings, rank=0)
    caches = {name: _joined_tensor() for name in LAYERS}
    worker.register_kv_caches(caches)
    keys = engine_block_keys(vllm_config, list(range(1, 200)))[:3]
    worker.wait_for_save(StepMetadata(saves=[BlockRun("w", 0, keys, [2, 3, 4])]))
    worker.handle_preemptions(StepMetadata(preempted={"w"}))  # waits for the saves
    return worker, caches, keys


def test_the_workers_loads_and_saves_skip_pydantic_and_ask_no_query(
    vllm_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On vLLM's step thread the worker builds its tasks without pydantic's validation (it
    made every field itself) and a load is one read: no query before it."""

    from kvcore.schemas import ReadTask, WriteTask

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("a task was validated on the step thread")

    for model in (ReadTask, WriteTask):
        monkeypatch.setattr(model, "model_validate", classmethod(refuse))
    worker, caches, keys = _worker_with_three_blocks_saved(vllm_config, "no-pydantic")
    backend = worker.handle.get()
    assert backend is not None
    queries_before = backend.metrics.snapshot().get("calls.query", 0.0)
    worker.start_load_kv(StepMetadata(loads=[BlockRun("r", 0, keys, [10, 11, 12])]))
    assert worker.get_block_ids_with_load_errors() == set()
    assert backend.metrics.snapshot().get("calls.query", 0.0) == queries_before
    for tensor in caches.values():
        assert torch.equal(tensor[10:13], tensor[2:5])
    stats = worker.take_stats()
    assert (stats["save_written_blocks"], stats["load_done_blocks"]) == (3, 3)
    # the first load is its client's first read (the client's setup): not a measure of the
    # store for the scheduler's read rate; the next one is
    assert "load_measured_bytes" not in stats
    worker.start_load_kv(StepMetadata(loads=[BlockRun("r2", 0, keys, [10, 11, 12])]))
    again = worker.take_stats()
    assert again["load_measured_bytes"] == again["load_bytes"] > 0
    assert again["load_measured_seconds"] == again["load_seconds"] > 0
    # a load the decision chose for its speed carries its pace to the manager: the expected
    # time and the break-even time (kvcore.ReadTask), so a load that loses is cut
    paced = BlockRun("p", 0, keys, [13, 14, 15], expected_s=0.5, break_even_s=0.6)
    task = worker._task(paced, "load", 5.0, worker.slices[0])
    assert (task.expected_s, task.break_even_s) == (0.5, 0.6)
    worker.close()


def test_a_sync_load_tells_the_store_the_engine_waits_idle_and_an_async_one_does_not(
    vllm_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync load runs before the step's compute: nothing of the engine computes while it
    waits, so its reads may be polled at the lowest priority (kvcore.ReadTask.caller_idle). An
    async load runs beside the engine's compute, where such a poller would wait for it."""

    from kvcore.transfer import TransferManager

    seen: list[bool] = []
    real_read = TransferManager.read

    def read(manager: TransferManager, task: Any) -> Any:
        seen.append(task.caller_idle)
        return real_read(manager, task)

    monkeypatch.setattr(TransferManager, "read", read)
    worker, caches, keys = _worker_with_three_blocks_saved(vllm_config, "idle-loads")
    worker.start_load_kv(StepMetadata(loads=[BlockRun("s", 0, keys, [10, 11, 12])]))
    assert seen == [True] and worker.get_block_ids_with_load_errors() == set()
    load = StepMetadata(loads=[BlockRun("a", 0, keys, [13, 14, 15])], async_loads=True)
    worker.start_load_kv(load)
    deadline = time.monotonic() + 60
    finished: set[str] | None = None
    while not finished and time.monotonic() < deadline:
        _, finished = worker.get_finished(set())
        time.sleep(0.01)
    assert finished == {"a"} and seen == [True, False]
    for tensor in caches.values():
        assert torch.equal(tensor[10:13], tensor[2:5]) and torch.equal(tensor[13:16], tensor[2:5])
    worker.close()


# -- the scheduler side --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "restores", "stores"),
    [("kv_both", True, True), ("kv_consumer", True, False), ("kv_producer", False, True)],
)
def test_kv_role_decides_restoring_and_storing(
    vllm_config: Any, role: str, restores: bool, stores: bool
) -> None:
    """A lookup finds stored blocks only where the role restores; a finished request's blocks
    are saved (and held until saved) only where it stores."""
    import copy

    import numpy as np
    from kvcore_vllm.keys import hashed_request
    from kvcore_vllm.scheduler import SchedulerSide

    config = copy.deepcopy(vllm_config)
    config.kv_transfer_config.kv_role = role
    config.parallel_config.distributed_executor_backend = "uni"  # memory: one process
    settings = ConnectorSettings(backend="memory", namespace=f"role-{role}")
    side = SchedulerSide(config, _kv_cache_config(), settings)
    tokens = [(7 * i) % 500 + 1 for i in range(100)]  # 3 full blocks and 4 tokens
    backend = side.handles[0].get()
    assert backend is not None
    request = hashed_request(config, "r1", tokens, max_tokens=4)
    keys = side.keys.keys(request, 0, 3)
    part = side.layout.part_bytes("k")
    arrays = [np.zeros(part, np.uint8) for _ in range(6)]
    host = kvcore.HostBuffers(
        ptrs=tuple((arrays[2 * i].ctypes.data, arrays[2 * i + 1].ctypes.data) for i in range(3)),
        nbytes=(part, part),
    )
    assert backend.write(backend.request("fill", keys, host=host)) == 3

    found = side.get_num_new_matched_tokens(request, 0)
    assert found == ((3 * BLOCK_SIZE, False) if restores else (0, False))
    side.update_state_after_alloc(request, None, 0)
    request.num_computed_tokens = len(tokens)
    assert side.request_finished(request, [0, 1, 2, 3]) == (stores, None)
    side.close()


def test_a_tp2_scheduler_looks_up_every_rank_through_one_client_that_mounts_no_memory(
    vllm_config: Any, mooncake_cluster_factory: Any
) -> None:
    """The scheduler of a TP=2 engine (workers in other processes) asks both ranks' presence
    through one Mooncake client opened for lookups: the master counts no memory mounted by it
    (a data client would mount its segment), and a block is found once both ranks stored it."""
    import copy

    import numpy as np
    from kvcore_vllm.keys import hashed_request
    from kvcore_vllm.scheduler import SchedulerSide

    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    config = copy.deepcopy(vllm_config)
    config.parallel_config.tensor_parallel_size = 2
    config.parallel_config.distributed_executor_backend = "mp"
    mounted_before = cluster.master.capacity_bytes()
    # a segment of its own if it were a data client: the master's count would grow by it
    settings = ConnectorSettings(
        backend="mooncake",
        backend_config=cluster.config(global_segment_size=32 << 20),
        namespace="one-client",
    )
    side = SchedulerSide(config, _kv_cache_config(), settings)
    try:
        assert len(side.handles) == 1
        client = side.handles[0].get()
        assert client is not None and client.context.role == "lookup"
        assert cluster.master.capacity_bytes() == mounted_before
        tokens = [(5 * i) % 500 + 1 for i in range(100)]  # 3 full blocks and 4 tokens
        request = hashed_request(config, "r1", tokens, max_tokens=4)
        keys = side.keys.keys(request, 0, 3)
        part = side.layout.part_bytes("k")
        arrays = [np.full(part, i, np.uint8) for i in range(6)]
        host = kvcore.HostBuffers(
            ptrs=tuple(
                (arrays[2 * i].ctypes.data, arrays[2 * i + 1].ctypes.data) for i in range(3)
            ),
            nbytes=(part, part),
        )
        queries_before = client.metrics.snapshot().get("calls.query", 0.0)
        for rank in (0, 1):  # each rank's worker stores its slice, through a data client
            writer = kvcore.open_backend(
                "mooncake",
                cluster.config(),
                context={
                    "layout": side.layout,
                    "rank": rank,
                    "world_size": 2,
                    "namespace": "one-client",
                },
            )
            try:
                assert writer.write(writer.request(f"fill-{rank}", keys, host=host)) == 3
            finally:
                writer.close()
            want = 3 * BLOCK_SIZE if rank == 1 else 0  # a block is there when every rank's is
            assert side.get_num_new_matched_tokens(request, 0) == (want, False)
        # two lookups, each one query per rank (rank 0 has all three blocks both times),
        # through the one client
        assert client.metrics.snapshot()["calls.query"] - queries_before == 2 * 2
        # it reads (kvcore_load_costs.probe_read measures the store through it: Mooncake's
        # capabilities say lookup_reads) into memory registered with it, and writes nothing
        assert client.capabilities.lookup_reads
        into = [np.zeros(part, np.uint8) for _ in range(6)]
        for array in into:
            client.register_buffer(array.ctypes.data, array.nbytes)
        got = kvcore.HostBuffers(
            ptrs=tuple((into[2 * i].ctypes.data, into[2 * i + 1].ctypes.data) for i in range(3)),
            nbytes=(part, part),
        )
        assert client.read(client.request("probe", keys, host=got, rank=1, world_size=2)) == 3
        assert all((into[i] == i).all() for i in range(6))
        with pytest.raises(ValueError, match=r"opened for lookups .* cannot write"):
            client.write(client.request("no", keys, host=host, rank=1, world_size=2))
        for array in into:
            client.unregister_buffer(array.ctypes.data)
    finally:
        side.close()


@pytest.mark.parametrize(
    ("tokens_per_s", "loads"),
    # computing at 1 token/s: loading wins at the bound of one block's read (a probe of one);
    # computing at 1e12 tokens/s: it never wins
    [(1.0, 20), (1e12, 0)],
)
def test_a_scheduler_whose_workers_run_elsewhere_measures_the_store_before_deciding(
    vllm_config: Any,
    mooncake_cluster_factory: Any,
    tokens_per_s: float,
    loads: int,
) -> None:
    """The first load-or-recompute decision of a fresh engine (TP=2: the workers in other
    processes, the scheduler's Mooncake client opened for lookups) is an informed one: the
    scheduler reads a block or three through its lookup client (Mooncake's lookup_reads)
    before it answers vLLM, as many as the decision needs."""
    import copy

    blocks_stored = 20
    import numpy as np
    from kvcore_vllm.keys import hashed_request
    from kvcore_vllm.scheduler import SchedulerSide

    cluster = mooncake_cluster_factory(storage_bytes=64 << 20)
    config = copy.deepcopy(vllm_config)
    config.parallel_config.tensor_parallel_size = 2
    config.parallel_config.distributed_executor_backend = "mp"
    settings = ConnectorSettings(
        backend="mooncake",
        backend_config=cluster.config(),
        namespace="probe-first",
        load_policy="auto",
        prefill_tokens_per_s=tokens_per_s,
    )
    side = SchedulerSide(config, _kv_cache_config(), settings)
    try:
        client = side.handles[0].get()
        assert client is not None and client.context.role == "lookup"
        # 20 full blocks and 4 tokens: more than one block's read may be extrapolated to
        tokens = [(7 * i) % 500 + 1 for i in range(blocks_stored * BLOCK_SIZE + 4)]
        request = hashed_request(config, "r1", tokens, max_tokens=4)
        keys = side.keys.keys(request, 0, blocks_stored)
        part = side.layout.part_bytes("k")
        arrays = [np.full(part, i, np.uint8) for i in range(2 * blocks_stored)]
        host = kvcore.HostBuffers(
            ptrs=tuple(
                (arrays[2 * i].ctypes.data, arrays[2 * i + 1].ctypes.data)
                for i in range(blocks_stored)
            ),
            nbytes=(part, part),
        )
        for rank in (0, 1):
            context = {"layout": side.layout, "rank": rank, "world_size": 2}
            writer = kvcore.open_backend(
                "mooncake", cluster.config(), context={**context, "namespace": "probe-first"}
            )
            try:
                assert (
                    writer.write(writer.request(f"fill-{rank}", keys, host=host)) == blocks_stored
                )
            finally:
                writer.close()
        # the workers' loads teach the rate here only where they measured the store: a
        # client's first read (a worker's first load) pays for the client's setup
        first_load = {"load_bytes": 1e6, "load_seconds": 0.05}
        side._learn_rates(SimpleNamespace(kv_connector_stats=SimpleNamespace(data=first_load)))
        assert not client.read_rate.known
        assert side.get_num_new_matched_tokens(request, 0) == (loads * BLOCK_SIZE, False)
        assert client.read_rate.known  # measured by the scheduler itself
        # between steps (sync loads, no async scheduling) nothing of the engine computes: the
        # probe's reads were polled from the client's lowest-priority threads
        assert side.probes_idle
        assert client.stats()["backend_reads_polled_in_background"] >= 2
        samples = client.read_rate.samples
        measured = {**first_load, "load_measured_bytes": 1e6, "load_measured_seconds": 0.05}
        side._learn_rates(SimpleNamespace(kv_connector_stats=SimpleNamespace(data=measured)))
        assert client.read_rate.samples == samples + 1
        decided = side.decider.counters.snapshot()
        assert decided["probes"] == 1 and decided["decisions"] == 1
        # the client's first read (one block) pays for its connection and measures nothing
        if loads:  # the next (two blocks) bounds the load far below recomputing
            assert decided["decisions_bounded"] == 1 and decided["probe_blocks"] == 3
        else:  # reads of more sizes say recompute (1, 2, 4, ... blocks until they tell
            # latency from bandwidth), or leave loading unproven (past the probe's budget, on a
            # busy machine)
            probed = decided.get("decisions_auto", 0) + decided.get("decisions_unproven", 0)
            assert probed == 1 and decided["probe_blocks"] >= 3
    finally:
        side.close()


def test_the_connectors_verify_blocks_setting_is_the_opened_backends() -> None:
    """``transfer.verify_blocks`` reaches the backend the handle opens (the worker's
    TransferManager refuses an opened backend whose setting differs from a non-auto one)."""
    context = kvcore.BackendContext(namespace="verify")
    never = connector_handle("memory", {}, context, retry_s=0, verify_blocks="never")
    auto = connector_handle("memory", {}, context, retry_s=0)
    try:
        assert never.get().verifies_blocks is False
        assert auto.get().verifies_blocks is True
        assert never.get() is not auto.get(), "shared across different verify_blocks"
    finally:
        never.close()
        auto.close()


# -- which ranks store what ---------------------------------------------------------------


def _parallel(tp: int, pp: int) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    )


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_a_replicated_cache_is_written_by_one_tp_rank_per_stage_and_read_by_all(
    tp: int, pp: int
) -> None:
    from kvcore_vllm.context import stored_ranks

    engine_ranks = range(tp * pp)  # pp_rank * tp + tp_rank
    mla = stored_ranks(_parallel(tp, pp), replicated=True)
    assert mla.world == pp
    assert [mla.object_rank(r) for r in engine_ranks] == [r // tp for r in engine_ranks]
    assert [r for r in engine_ranks if mla.writes(r)] == [stage * tp for stage in range(pp)]
    # every other model: each rank its own slice, written and read by it alone
    own = stored_ranks(_parallel(tp, pp), replicated=False)
    assert own.world == tp * pp
    assert [own.object_rank(r) for r in engine_ranks] == list(engine_ranks)
    assert all(own.writes(r) for r in engine_ranks)


def test_head_slices_name_each_kv_head_whatever_the_tp_degree() -> None:
    from kvcore_vllm.context import HeadSlices, Slice

    def plan(tp: int, pp: int = 1) -> list[list[tuple[int, int, int, bool]]]:
        p = HeadSlices(kv_heads=2, tp=tp, pp=pp)
        return [[(s.rank, s.world, s.local, s.writes) for s in p.slices(r)] for r in range(tp * pp)]

    assert plan(1) == [[(0, 2, 0, True), (1, 2, 1, True)]]
    assert plan(2) == [[(0, 2, 0, True)], [(1, 2, 0, True)]]
    # more TP ranks than KV heads: two ranks hold each head, the first of them writes it
    assert plan(4) == [[(0, 2, 0, True)], [(0, 2, 0, False)], [(1, 2, 0, True)], [(1, 2, 0, False)]]
    # pipeline stages keep their own heads' names
    assert plan(2, pp=2) == [
        [(0, 4, 0, True)],
        [(1, 4, 0, True)],
        [(2, 4, 0, True)],
        [(3, 4, 0, True)],
    ]
    assert HeadSlices(2, 2, 2).all_slices() == [Slice(r, 4) for r in range(4)]


def test_a_block_written_per_head_at_tp1_restores_into_a_tp2_rank() -> None:
    """The per-head layout: a TP=1 engine's block (both KV heads, CPU form) stored as one object
    set per head; a TP=2 rank holding head 1 restores exactly that head's bytes."""
    from kvcore_vllm.context import HeadSlices

    spec_tp1 = None  # the default spec: 2 KV heads of 32
    layout = cache_layout(_kv_cache_config(spec_tp1), per_head=True)
    assert layout.num_heads == 1
    tp1 = {name: _joined_tensor() for name in LAYERS}  # [blocks, 2 heads, block_size, 2 x 32]
    m1 = map_layer_tensors(tp1, LAYERS, layout, NUM_BLOCKS, pieces=2)
    assert m1.pieces == 2 and m1.to_kvcore([3], piece=1) == [7]
    backend = kvcore.open_backend("memory", {}, context={"layout": layout})
    keys = ["c" * 64, "d" * 64]
    config = {"layout": m1.layout, "max_model_len": 2048}
    with TransferManager(config, DeviceCache(m1.layout, m1.k, m1.v), backend) as tm:
        for piece in HeadSlices(kv_heads=2, tp=1, pp=1).slices(0):
            task = {"task_id": f"w{piece.rank}", "keys": keys, "rank": piece.rank,
                    "world_size": piece.world,
                    "device_block_ids": m1.to_kvcore([3, 5], piece.local)}  # fmt: skip
            assert tm.write_back(task).result().num_blocks == 2
    # TP=2, rank 1: one KV head per block, the model's head 1
    tp2 = {name: torch.zeros(NUM_BLOCKS, 1, BLOCK_SIZE, 2 * 32, dtype=torch.bfloat16)
           for name in LAYERS}  # fmt: skip
    m2 = map_layer_tensors(tp2, LAYERS, layout, NUM_BLOCKS, pieces=1)
    (piece,) = HeadSlices(kv_heads=2, tp=2, pp=1).slices(1)
    with TransferManager(config, DeviceCache(m2.layout, m2.k, m2.v), backend) as tm:
        task = {"task_id": "r", "keys": keys, "rank": piece.rank, "world_size": piece.world,
                "device_block_ids": m2.to_kvcore([8, 9], piece.local)}  # fmt: skip
        assert tm.read(task).result().num_blocks == 2
    backend.close()
    for name in LAYERS:
        assert torch.equal(tp2[name][8, 0], tp1[name][3, 1])
        assert torch.equal(tp2[name][9, 0], tp1[name][5, 1])
        assert not tp2[name][[b for b in range(NUM_BLOCKS) if b not in (8, 9)]].any()


def test_the_per_head_layout_refuses_a_cache_whose_heads_interleave() -> None:
    layout = cache_layout(_kv_cache_config(), per_head=True)
    nhd = {name: torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 32, dtype=torch.bfloat16)
           for name in LAYERS}  # fmt: skip
    with pytest.raises(UnsupportedCacheError, match="object_layout per_head needs"):
        map_layer_tensors(nhd, LAYERS, layout, NUM_BLOCKS, pieces=2)
    hnd = {name: torch.zeros(2, NUM_BLOCKS, 2, BLOCK_SIZE, 32, dtype=torch.bfloat16)
           for name in LAYERS}  # fmt: skip
    assert map_layer_tensors(hnd, LAYERS, layout, NUM_BLOCKS, pieces=2).kv_format == FORM_SPLIT


# -- hybrid models' KV cache groups --------------------------------------------------------


def _groups_config(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = []
    for i, spec in enumerate(specs):
        layers = [f"model.layers.{2 * i + j}.attn" for j in range(2)]
        groups.append(KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec))
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def test_a_hybrid_models_groups_are_stored_full_attention_first() -> None:
    from kvcore_vllm.layout import cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    dense = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 32, "dtype": torch.bfloat16}
    window = SlidingWindowSpec(**dense, sliding_window=64)
    groups = cache_groups(_groups_config(window, FullAttentionSpec(**dense)))
    assert [(g.index, g.kind, g.window) for g in groups] == [(1, "full", None),
                                                             (0, "sliding_window", 64)]  # fmt: skip
    full, swa = groups
    # a restore of 10 blocks computes token 320 next: its window is tokens 257..320
    assert swa.first_needed_block(10, BLOCK_SIZE) == (10 * BLOCK_SIZE - 64 + 1) // BLOCK_SIZE == 8
    assert swa.first_needed_block(1, BLOCK_SIZE) == 0 and full.first_needed_block(10, 32) == 0
    # each group's layout is its own layers
    config = _groups_config(window, FullAttentionSpec(**dense))
    assert cache_layout(config, group=swa).num_layers == 2


def test_a_group_the_connector_cannot_restore_is_refused_in_one_line() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    dense = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 32, "dtype": torch.bfloat16}
    mamba = MambaSpec(block_size=BLOCK_SIZE, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    with pytest.raises(UnsupportedCacheError) as refused:
        cache_layout(_groups_config(FullAttentionSpec(**dense), mamba))
    message = str(refused.value)
    assert message.startswith("KV cache group 1 (MambaSpec, 2 layers): ") and "\n" not in message


def _store_blocks(group_store: Any, first: int, end: int, *, request: Any) -> None:
    """Write blocks ``first .. end - 1`` of ``request`` (zeros) under a group's keys, as a
    store the scheduler's lookups then find."""
    import numpy as np

    backend = group_store.handle.get()
    part = group_store.layout.part_bytes("k")
    arrays = [np.zeros(part, np.uint8) for _ in range(2 * (end - first))]
    ptrs = tuple((arrays[2 * i].ctypes.data, arrays[2 * i + 1].ctypes.data)
                 for i in range(end - first))  # fmt: skip
    keys = group_store.keys.keys(request, first, end)
    host = kvcore.HostBuffers(ptrs=ptrs, nbytes=(part, part))
    done = backend.write(backend.request("fill", keys, start_block=first, host=host))
    assert done == end - first


def test_a_hybrid_request_loads_and_saves_each_group_in_its_own_blocks(vllm_config: Any) -> None:
    """The scheduler side of a hybrid model whose full-attention group is vLLM's group 1: a
    restore needs the full group's leading run and the window's blocks of the sliding group
    (group 0); each run names its own group and block ids; a missing window restores nothing;
    a save stores the sliding group's blocks vLLM still holds (not its null placeholders)."""
    import copy
    from types import SimpleNamespace

    from kvcore_vllm.keys import hashed_request
    from kvcore_vllm.scheduler import SchedulerSide
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    config = copy.deepcopy(vllm_config)
    config.parallel_config.distributed_executor_backend = "uni"  # memory: one process
    dense = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 32, "dtype": torch.bfloat16}
    kv_config = _groups_config(
        SlidingWindowSpec(**dense, sliding_window=64), FullAttentionSpec(**dense)
    )
    side = SchedulerSide(config, kv_config, ConnectorSettings(backend="memory", namespace="hyb"))
    full, swa = side.stores
    assert (full.group.index, swa.group.index) == (1, 0)
    tokens = [(7 * i) % 500 + 1 for i in range(10 * BLOCK_SIZE + 4)]
    request = hashed_request(config, "h1", tokens, max_tokens=4)

    store = functools.partial(_store_blocks, request=request)

    store(full, 0, 10)
    # the window of a restore of 10 blocks (next token 320: tokens 257..320) is blocks 8, 9
    assert side.get_num_new_matched_tokens(request, 0) == (0, False), "no window stored"
    assert side.counters.take()["lookup_window_missing"] == 1
    store(swa, 8, 10)
    # a hybrid model's blocks load in the background (load_mode auto)
    assert side.get_num_new_matched_tokens(request, 0) == (10 * BLOCK_SIZE, True)
    full_ids = list(range(21, 31))
    swa_ids = [0] * 8 + [41, 42]  # vLLM's null placeholders before the window
    blocks = SimpleNamespace(get_block_ids=lambda: (swa_ids, full_ids))
    side.update_state_after_alloc(request, blocks, 10 * BLOCK_SIZE)
    loads = {(run.group, run.start_block, tuple(run.block_ids)) for run in side._loads}
    assert loads == {(1, 0, tuple(full_ids)), (0, 8, (41, 42))}

    # a request computed from scratch whose sliding blocks 0..6 were already freed by vLLM
    other = hashed_request(config, "h2", [t + 1 for t in tokens], max_tokens=4)
    side.get_num_new_matched_tokens(other, 0)
    side.update_state_after_alloc(other, blocks, 0)
    other.num_computed_tokens = len(tokens)
    held = [0] * 7 + [51, 52, 53]
    assert side.request_finished_all_groups(other, (held, list(range(60, 70))))[0]
    saves = {(run.group, run.start_block, tuple(run.block_ids)) for run in side._final_saves}
    assert saves == {(1, 0, tuple(range(60, 70))), (0, 7, (51, 52, 53))}
    side.close()


def test_blocks_stored_but_recomputed_are_not_saved_again(vllm_config: Any) -> None:
    """A decision that recomputes a stored prefix (here ``load_policy`` never, as ``auto``
    declines a slow store) leaves those blocks in the store: computing them must not save
    them again (each copied to host memory only for the write to find it stored, 96 MB for a
    4,000-token prompt on the cores that compute it). Blocks past the stored run are saved."""
    import copy
    from types import SimpleNamespace

    from kvcore_vllm.keys import hashed_request
    from kvcore_vllm.scheduler import SchedulerSide
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    config = copy.deepcopy(vllm_config)
    config.parallel_config.distributed_executor_backend = "uni"  # memory: one process
    dense = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 32, "dtype": torch.bfloat16}
    settings = ConnectorSettings(backend="memory", namespace="declined", load_policy="never")
    side = SchedulerSide(config, _groups_config(FullAttentionSpec(**dense)), settings)
    try:
        tokens = [(7 * i) % 500 + 1 for i in range(10 * BLOCK_SIZE + 4)]
        request = hashed_request(config, "d1", tokens, max_tokens=4)
        _store_blocks(side.stores[0], 0, 6, request=request)
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        assert side.decider.counters.snapshot()["blocks_declined"] == 6
        ids = list(range(30, 40))
        side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (ids,)), 0)
        request.num_computed_tokens = len(tokens)
        assert side.request_finished(request, ids)[0]
        saves = [(run.start_block, tuple(run.block_ids)) for run in side._final_saves]
        assert saves == [(6, (36, 37, 38, 39))]  # blocks 0..5 are stored already
    finally:
        side.close()


# -- Mamba state groups ----------------------------------------------------------------------


def _mamba_spec(ssm_dtype: Any = torch.float32, mode: str = "align") -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    # a conv state of 3 x 16 bfloat16 and an SSM state of 2 x 8 x 8, padded to one attention
    # page (2 KV heads x 32 x 32 x 2 bytes x K and V = 8 KiB)
    return MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((3, 16), (2, 8, 8)),
        dtypes=(torch.bfloat16, ssm_dtype),
        page_size_padded=8192,
        mamba_cache_mode=mode,
    )


def test_a_mamba_group_is_stored_as_whole_state_pages_under_a_scope_naming_the_state() -> None:
    from kvcore_vllm.keys import _group_text
    from kvcore_vllm.layout import cache_groups, map_state_tensors
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    dense = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 32, "dtype": torch.bfloat16}
    config = _groups_config(_mamba_spec(), FullAttentionSpec(**dense))
    full, state = cache_groups(config)
    assert (full.kind, state.kind, state.window, state.is_state) == ("full", "mamba", 32, True)
    # a restore of 10 blocks needs the state at token 320: block 9's
    assert state.first_needed_block(10, BLOCK_SIZE) == 9
    layout = cache_layout(config, group=state)
    assert (layout.dtype.value, 2 * layout.kv_layer_block_bytes) == ("uint8", 8192)
    with pytest.raises(UnsupportedCacheError, match="object_layout per_head"):
        cache_layout(config, per_head=True, group=state)
    # two models whose states differ in dtype never share a key scope
    other = cache_groups(_groups_config(_mamba_spec(torch.bfloat16), FullAttentionSpec(**dense)))
    assert _group_text(state) != _group_text(other[1])
    assert "bfloat16" in _group_text(other[1]) and "float32" in _group_text(state)

    # vLLM's views: one raw page per block, each state a strided view starting in it
    raw = torch.arange((NUM_BLOCKS + 1) * 8192, dtype=torch.int64).to(torch.uint8)
    conv = torch.as_strided(raw.view(torch.bfloat16), (NUM_BLOCKS, 3, 16), (4096, 16, 1))
    ssm = torch.as_strided(raw.view(torch.float32), (NUM_BLOCKS, 2, 8, 8), (2048, 64, 8, 1), 24)
    names = list(state.layer_names)
    mapping = map_state_tensors({n: [conv, ssm] for n in names}, names, layout, NUM_BLOCKS)
    pages = mapping.k + mapping.v
    assert all(p.data_ptr() == raw.data_ptr() for p in pages[:1])
    assert bytes(pages[0][3].numpy()) == bytes(raw[3 * 8192 : 4 * 8192].numpy())
    # a state that runs past its page is refused, naming the layer
    wide = torch.as_strided(raw.view(torch.float32), (NUM_BLOCKS, 2, 8, 8), (2048, 64, 8, 1), 2000)
    with pytest.raises(UnsupportedCacheError, match=names[0]):
        map_state_tensors({n: [conv, wide] for n in names}, names, layout, NUM_BLOCKS)
    # vLLM keeps no per-block state without prefix caching: refused in one line
    with pytest.raises(UnsupportedCacheError, match="mamba_cache_mode is 'none'"):
        cache_groups(_groups_config(FullAttentionSpec(**dense), _mamba_spec(mode="none")))


def test_a_mamba_restore_ends_at_a_stored_state_and_saves_store_the_state_of_each_step(
    vllm_config: Any,
) -> None:
    """The scheduler side of a Mamba hybrid: a restore ends at the last boundary inside the
    attention run whose state is stored and loads that one state block; a save stores the
    state block of the step's last full block only (the blocks before it hold no state)."""
    import copy
    from types import SimpleNamespace

    from kvcore_vllm.keys import hashed_request
    from kvcore_vllm.scheduler import SchedulerSide
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    config = copy.deepcopy(vllm_config)
    config.parallel_config.distributed_executor_backend = "uni"  # memory: one process
    dense = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 32, "dtype": torch.bfloat16}
    kv_config = _groups_config(FullAttentionSpec(**dense), _mamba_spec())
    side = SchedulerSide(config, kv_config, ConnectorSettings(backend="memory", namespace="mb"))
    full, state = side.stores
    tokens = [(5 * i) % 500 + 1 for i in range(10 * BLOCK_SIZE + 4)]
    request = hashed_request(config, "m1", tokens, max_tokens=4)

    store = functools.partial(_store_blocks, request=request)

    store(full, 0, 10)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False), "no state stored"
    assert side.counters.take()["lookup_state_missing"] == 1
    store(state, 5, 6)  # the state at token 192
    assert side.get_num_new_matched_tokens(request, 0) == (6 * BLOCK_SIZE, True)
    state_ids = [0] * 5 + [71, 72]  # vLLM: the restored state's block, then the running one
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(21, 28)), state_ids))
    side.update_state_after_alloc(request, blocks, 6 * BLOCK_SIZE)
    loads = {(run.group, run.start_block, tuple(run.block_ids)) for run in side._loads}
    assert loads == {(0, 0, tuple(range(21, 27))), (1, 5, (71,))}

    # a save of blocks 0..9 stores the attention blocks and block 9's state only
    other = hashed_request(config, "m2", [t + 1 for t in tokens], max_tokens=4)
    side.get_num_new_matched_tokens(other, 0)
    side.update_state_after_alloc(other, blocks, 0)
    other.num_computed_tokens = len(tokens)
    held = [0, 0, 0, 0, 81, 0, 0, 0, 0, 82, 83]  # a state kept at block 4, then 9 and running
    assert side.request_finished_all_groups(other, (list(range(60, 71)), held))[0]
    saves = {(run.group, run.start_block, tuple(run.block_ids)) for run in side._final_saves}
    assert saves == {(0, 0, tuple(range(60, 70))), (1, 9, (82,))}
    side.close()


def test_the_state_dtypes_of_a_model_with_cached_recurrent_state_are_in_its_scope(
    vllm_config: Any,
) -> None:
    """The secondary tier keys chunks by the model's settings alone: a float32 and a bfloat16
    SSM state (padded to the same page size) must not share keys; other models' scopes keep
    their fields."""
    import copy

    from kvcore_vllm.keys import model_settings

    plain = model_settings(vllm_config)
    assert "mamba_ssm_cache_dtype" not in plain
    f32, bf16 = copy.deepcopy(vllm_config), copy.deepcopy(vllm_config)
    for config, dtype in ((f32, "float32"), (bf16, "bfloat16")):
        config.cache_config.mamba_cache_mode = "align"
        config.cache_config.mamba_ssm_cache_dtype = dtype
    assert model_settings(f32)["mamba_ssm_cache_dtype"] == "float32"
    assert model_settings(f32) != model_settings(bf16)


def _described_request(salt: str | None = None) -> Any:
    """A real vLLM request (its own block hashes and extra keys) of two full blocks."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    return Request(
        request_id=f"r-{salt}",
        prompt_token_ids=list(range(1, 2 * BLOCK_SIZE + 4)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256_cbor),
    )


def test_a_block_descriptor_round_trips_and_refuses_what_is_not_one() -> None:
    from kvcore_vllm.descriptors import BlockDescriber, decode, encode

    keys = RequestKeys(kvcore.KeyScope(model="m"), BLOCK_SIZE, BLOCK_SIZE)
    describer = BlockDescriber(BLOCK_SIZE, keys)
    request = _described_request("tenant-a")
    described = describer.describe(request, keys.keys(request, 0, 2), 0)
    for key, facts in described:
        raw = encode(facts)
        assert 0 < len(raw) <= kvcore.MAX_BLOCK_META_BYTES
        assert decode(raw) == facts  # the salt's extra keys come back as vLLM's tuples
        assert describer.matches(key, facts)
    (key0, facts0), (key1, facts1) = described
    assert facts1.parent_hash == facts0.block_hash and facts0.parent_hash is None
    assert facts0.extra_keys == [("tenant-a",)]  # vLLM's event form: the bare salt
    # a descriptor read under another key (a lying or misplaced object) is not that block's
    assert not describer.matches(key1, facts0)
    other = RequestKeys(kvcore.KeyScope(model="m", namespace="other"), BLOCK_SIZE, BLOCK_SIZE)
    assert not BlockDescriber(BLOCK_SIZE, other).matches(key0, facts0)
    for junk in (b"", b"\xc1", encode(facts0)[:-3], b"\x93\x01\x02\x03"):
        assert decode(junk) is None
    import msgspec

    future = msgspec.msgpack.encode([2, 1, None, [1] * BLOCK_SIZE, BLOCK_SIZE, None, None, None])
    assert decode(future) is None  # a format this reader does not know
    big = dataclasses.replace(facts0, token_ids=list(range(10**6, 10**6 + 1000)))
    assert encode(big) == b""  # too large to store: no descriptor, never a truncated one


def test_blocks_another_engine_stored_are_announced_only_by_their_own_descriptor() -> None:
    from kvcore_vllm.descriptors import BlockDescriber, encode
    from kvcore_vllm.events import SchedulerEvents
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    keys = RequestKeys(kvcore.KeyScope(model="m"), BLOCK_SIZE, BLOCK_SIZE)
    describer = BlockDescriber(BLOCK_SIZE, keys)
    request = _described_request()
    (k0, f0), (k1, _) = describer.describe(request, keys.keys(request, 0, 2), 0)
    events = SchedulerEvents(2, describer)  # two ranks: a block is whole with both slices
    events.receive_records([("stored", k0, 0), ("stored", k1, 0), ("stored", k0, 1)])
    assert events.to_describe(10) == [k0]  # k1 lacks rank 1: not loadable yet
    events.receive_records([("stored", k1, 1)])
    assert events.to_describe(10) == [k0, k1]
    # k1's object carries k0's descriptor: never announced under k1's key, counted
    events.described([k0, k1], [encode(f0), encode(f0)])
    out = events.take()
    assert [type(e) for e in out] == [BlockStored] and out[0].block_hashes == [f0.block_hash]
    assert events.unmapped == 1
    # no descriptor at all (written before descriptors): counted, not guessed
    events.receive_records([("removed", k1, 0), ("stored", k1, 0), ("stored", k1, 1)])
    events.described(events.to_describe(10), [None])
    assert events.unmapped == 2 and events.take() == []
    # removals: only what was announced, once
    events.receive_records([("removed", k1, 1), ("removed", k0, 1), ("removed", k0, 0)])
    assert [(type(e), e.block_hashes) for e in events.take()] == [(BlockRemoved, [f0.block_hash])]
    # while a follower publishes, the step takes nothing (one path, in order)
    events.receive_records([("stored", k0, 0), ("stored", k0, 1)])
    events.described([k0], [encode(f0)])
    events.published_elsewhere = True
    assert events.take() == []
    assert [type(e) for e in events.take(publisher=True)] == [BlockStored]


def test_an_engine_that_can_follow_no_more_blocks_withdraws_the_oldest() -> None:
    from kvcore_vllm.descriptors import BlockDescriber
    from kvcore_vllm.events import SchedulerEvents
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    keys = RequestKeys(kvcore.KeyScope(model="m"), BLOCK_SIZE, BLOCK_SIZE)
    describer = BlockDescriber(BLOCK_SIZE, keys)
    request = _described_request()
    described = describer.describe(request, keys.keys(request, 0, 2), 0)
    events = SchedulerEvents(1, describer, max_known_blocks=1)
    events.known(described)
    out = events.take()
    assert [type(e) for e in out] == [BlockStored, BlockStored, BlockRemoved]
    assert out[2].block_hashes == out[0].block_hashes  # the first, withdrawn


def test_an_engine_that_fails_to_start_reports_its_root_cause() -> None:
    """vLLM's engine core logs why it failed in its own process; the front end's traceback
    ("See root cause above") comes last. A test's failure message carries the first."""
    from kvcore_vllm.session import failure_report

    root = [
        "(EngineCore pid=7) ERROR 11-29 07:01:02 [core.py:1] EngineCore failed to start.",
        "(EngineCore pid=7) Traceback (most recent call last):",
        '(EngineCore pid=7)   File "vllm/v1/engine/core.py", line 9, in run_engine_core',
        "(EngineCore pid=7)     engine_core = EngineCoreProc(*args, **kwargs)",
        "(EngineCore pid=7) torch.OutOfMemoryError: the root cause, 12 GiB asked",
    ]
    noise = [f"INFO 11-29 07:01:03 [loader.py:1] line {i}" for i in range(200)]
    front = [
        "Traceback (most recent call last):",
        '  File "kvcore_vllm/session.py", line 1, in <module>',
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {}",
    ]
    report = failure_report("\n".join(["INFO start", *root, *noise, *front]))
    assert "torch.OutOfMemoryError: the root cause, 12 GiB asked" in report
    assert "EngineCore failed to start" in report  # the error lines
    assert "See root cause above" in report
    assert "line 20\n" not in report  # the noise between them left out


def test_a_fresh_engine_starts_from_the_prefill_profile_the_engine_before_it_left(
    vllm_config: Any, tmp_path: Any
) -> None:
    """The prefill steps an engine times are kept for the next engine of the same model and
    settings on this machine (``prefill_profile``): its first decision estimates a long
    prompt from them, not from its warm-up's short steps alone. An engine unlike it (another
    step budget) and one with ``prefill_profile`` off start from nothing."""
    import copy
    from types import SimpleNamespace

    from kvcore_vllm.scheduler import SchedulerSide
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    config = copy.deepcopy(vllm_config)
    config.parallel_config.distributed_executor_backend = "uni"  # memory: one process
    dense = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 32, "dtype": torch.bfloat16}
    kv_config = _groups_config(FullAttentionSpec(**dense))
    where = str(tmp_path / "profiles")

    def engine(vllm: Any, profile: str = where) -> Any:
        settings = ConnectorSettings(backend="memory", namespace="pp", prefill_profile=profile)
        return SchedulerSide(vllm, kv_config, settings)

    def step(side: Any, seconds: float, batch: list[tuple[int, int]]) -> None:
        side._step_batch = batch  # what build_connector_meta records of the step it sends
        stats = SimpleNamespace(data={"forward_seconds": seconds, "forward_steps": 1.0})
        side.update_connector_output(
            SimpleNamespace(kv_connector_stats=stats, kv_cache_events=None)
        )

    first = engine(config)
    try:
        assert first.decider.prefill.seeded == 0
        step(first, 0.02, [(64, 0)])
        step(first, 0.6, [(2000, 0)])  # written at once: longer than anything kept
        step(first, 0.9, [(2000, 2000)])
    finally:
        first.close()
    files = list((tmp_path / "profiles").glob("*.json"))
    assert len(files) == 1
    second = engine(config)
    try:
        assert second.decider.prefill.seeded == 3
        assert second.decider.prefill.estimate_s(4000) == pytest.approx(1.5, rel=0.1)
    finally:
        second.close()
    other = copy.deepcopy(config)
    other.scheduler_config.max_num_batched_tokens *= 2
    for side in (engine(other), engine(config, "off")):
        try:
            assert side.decider.prefill.seeded == 0
        finally:
            side.close()


def test_a_sync_load_decision_counts_the_requests_vllm_has_waiting() -> None:
    """vLLM asks the connector about one request at a time, while it is still at its queue's
    head; a synchronous load holds up every request waiting behind it (both of vLLM's
    waiting queues), which the decision counts (``LoadDecider(waiting=...)``)."""
    from kvcore_vllm.publisher import EventPublisherRef

    class Scheduler:  # what the connector reads of vLLM's scheduler
        waiting: list[str] = ["asking", "b", "c", "d"]
        kv_holding_waiting: list[str] = ["e"]

    scheduler = Scheduler()
    ref = EventPublisherRef(scheduler)
    assert ref.others_waiting() == 4
    scheduler.waiting, scheduler.kv_holding_waiting = ["asking"], []
    assert ref.others_waiting() == 0
    assert EventPublisherRef(None).others_waiting() == 0
