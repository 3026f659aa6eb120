"""The in-process plugin (``KVCoreStoragePlugin``) inside LMCache's own in-process
``StorageManager`` on CPU, loaded by LMCache's storage-plugin launcher from an engine config
as a user writes it, over kv_file: chunks put through the manager come back byte for byte from
a fresh manager (an engine restart), allocated from LMCache's local CPU backend with the
stored layout; every field of LMCache's ``CacheEngineKey`` keeps chunks apart; a corrupt chunk
is a miss."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvcore_lmcache.plugin import KVCoreStoragePlugin, plugin_settings
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

SHAPE = (2, 2, 256, 4, 32)  # (num_layers, 2, chunk_size, heads, head_dim)


def engine_config(root: Path, **extra: Any) -> LMCacheEngineConfig:
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=True, max_local_cpu_size=0.1, lmcache_instance_id="kvcore-test"
    )
    config.storage_plugins = ["kvcore"]
    config.extra_config = {
        "storage_plugin.kvcore.module_path": "kvcore_lmcache.plugin",
        "storage_plugin.kvcore.class_name": "KVCoreStoragePlugin",
        "storage_plugin.kvcore.backend": "file",
        "storage_plugin.kvcore.backend_config": {"root": str(root)},
        **extra,
    }
    return config


def metadata(dtype: torch.dtype = torch.bfloat16) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="org/tiny",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=SHAPE,
    )


@pytest.fixture
def managers(tmp_path: Path) -> Iterator[Any]:
    made: list[StorageManager] = []

    def make(dtype: torch.dtype = torch.bfloat16, **extra: Any) -> StorageManager:
        manager = StorageManager(
            config=engine_config(tmp_path / "store", **extra),
            metadata=metadata(dtype),
            event_manager=EventManager(),
        )
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.close()


def plugin_of(manager: StorageManager) -> KVCoreStoragePlugin:
    plugin = manager.storage_backends.get("kvcore")
    assert isinstance(plugin, KVCoreStoragePlugin), list(manager.storage_backends)
    return plugin


def key(i: int, **fields: Any) -> CacheEngineKey:
    base: dict[str, Any] = {
        "model_name": "org/tiny",
        "world_size": 1,
        "worker_id": 0,
        "chunk_hash": 0x5EED0000 + i,
        "dtype": torch.bfloat16,
    }
    base.update(fields)
    return CacheEngineKey(**base)


def chunk(manager: StorageManager, seed: int) -> Any:
    obj = manager.allocate(torch.Size(SHAPE), torch.bfloat16, fmt=MemoryFormat.KV_2LTD)
    assert obj is not None
    gen = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randn(SHAPE, generator=gen).to(torch.bfloat16))
    return obj


def put_and_wait(manager: StorageManager, keys: list[CacheEngineKey], seeds: list[int]) -> list:
    objs = [chunk(manager, s) for s in seeds]
    expected = [o.tensor.clone() for o in objs]
    manager.batched_put(keys, objs, location="kvcore")
    plugin = plugin_of(manager)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and plugin.batched_contains(keys) < len(keys):
        time.sleep(0.02)
    assert plugin.batched_contains(keys) == len(keys)
    return expected


def test_chunks_come_back_byte_for_byte_after_an_engine_restart(managers):
    first = managers()
    keys = [key(i) for i in range(3)]
    expected = put_and_wait(first, keys, [1, 2, 3])
    first.close()

    again = managers()  # a fresh engine: its local CPU cache is empty
    assert plugin_of(again).batched_contains(keys) == 3
    for k, want in zip(keys, expected, strict=True):
        got = plugin_of(again).get_blocking(k)
        assert got is not None
        assert got.get_shape() == torch.Size(SHAPE) and got.get_dtype() == torch.bfloat16
        assert torch.equal(got.tensor, want)
        got.ref_count_down()
    # and through LMCache's own manager
    got = again.get(keys[0], location="kvcore")
    assert got is not None and torch.equal(got.tensor, expected[0])


@pytest.mark.parametrize(
    "field,other",
    [
        ("model_name", "org/tiny-instruct"),
        ("world_size", 2),
        ("worker_id", 1),
        ("dtype", torch.float16),
        ("request_configs", {"lmcache.tag.tenant": "b"}),
    ],
)
def test_keys_differing_in_one_field_never_share_a_chunk(managers, field, other):
    manager = managers()
    stored = key(7, request_configs={"lmcache.tag.tenant": "a"})
    put_and_wait(manager, [stored], [7])
    probe = key(7, **{"request_configs": {"lmcache.tag.tenant": "a"}, field: other})
    assert probe != stored
    plugin = plugin_of(managers())
    assert plugin.contains(probe) is False
    assert plugin.get_blocking(probe) is None
    assert plugin.contains(stored) is True


def test_a_flipped_bit_is_a_miss_never_the_bytes(managers, tmp_path):
    manager = managers()
    k = key(1)
    expected = put_and_wait(manager, [k], [1])
    payload = expected[0].view(torch.uint8).numpy().tobytes()
    for path in (tmp_path / "store").rglob("*"):
        data = path.read_bytes() if path.is_file() else b""
        at = data.find(payload[:4096])
        if at >= 0:
            flipped = bytearray(data)
            flipped[at + 100] ^= 0x10
            path.write_bytes(bytes(flipped))
            break
    else:
        raise AssertionError("no stored file holds the chunk")
    plugin = plugin_of(managers())
    assert plugin.get_blocking(k) is None


def test_pins_keep_a_chunk_from_lmcaches_removal_until_forced(managers):
    manager = managers()
    k = key(3)
    put_and_wait(manager, [k], [3])
    plugin = plugin_of(manager)
    assert plugin.contains(k, pin=True)
    assert plugin.remove(k, force=False) is False
    assert plugin.unpin(k)
    assert plugin.remove(k, force=False) is True
    assert plugin.contains(k) is False


def test_settings_are_read_for_this_plugin_and_a_typo_names_the_key(tmp_path):
    extra = engine_config(tmp_path).extra_config
    settings = plugin_settings(extra, "KVCoreStoragePlugin")
    assert settings.backend == "file"
    extra["storage_plugin.kvcore.backend_confg"] = {}
    with pytest.raises(ValueError, match="backend_confg"):
        plugin_settings(extra, "KVCoreStoragePlugin")
    with pytest.raises(ValueError, match="0 storage plugins"):
        plugin_settings({}, "KVCoreStoragePlugin")


def test_a_backend_that_keeps_no_layout_is_refused_at_start(tmp_path, no_meta_backend):
    config = engine_config(tmp_path)
    config.extra_config["storage_plugin.kvcore.backend"] = no_meta_backend
    config.extra_config["storage_plugin.kvcore.backend_config"] = {}
    with pytest.raises(ValueError, match="keeps no block metadata"):
        KVCoreStoragePlugin(config=config, metadata=metadata())


def test_the_stores_admission_policy_is_honoured(managers, tmp_path):
    """kv_file's ``admission: second-hit``: a chunk put once is not written, put again it is
    (and reads back byte for byte)."""
    config = {
        "root": str(tmp_path / "store"),
        "admission": "second-hit",
        "capacity_bytes": 64 << 20,
    }
    manager = managers(**{"storage_plugin.kvcore.backend_config": config})
    plugin = plugin_of(manager)
    keys = [key(i) for i in range(2)]
    objs = [chunk(manager, 40 + i) for i in range(2)]
    stored: list[CacheEngineKey] = []
    for _ in range(2):
        futures = plugin.batched_submit_put_task(keys, objs, on_complete_callback=stored.append)
        for future in futures or []:
            future.result(timeout=60)
        if not stored:
            assert plugin.batched_contains(keys) == 0  # offered once: refused, not written
    assert stored == keys
    assert plugin.batched_contains(keys) == 2
    for k, obj in zip(keys, objs, strict=True):
        got = plugin.get_blocking(k)
        assert got is not None and torch.equal(got.tensor, obj.tensor)
        got.ref_count_down()
    status = plugin.report_status()
    assert status["host.blocks_refused.write"] == 2 and status["host.blocks_done.write"] == 2


def test_lookups_answer_only_the_chunks_worth_loading(managers):
    """LMCache's lookups go through kvcore's load-or-recompute decision (the rule of the
    core's tests/test_load_costs.py), weighed by the store's read rate measured from the
    plugin's own reads: an engine that computes a chunk ten times faster than this store reads
    it gets fewer chunks than are stored; one ten times slower gets them all."""
    keys = [key(i) for i in range(4)]
    writer = managers()
    put_and_wait(writer, keys, [1, 2, 3, 4])
    plugin = plugin_of(writer)
    for _ in range(3):  # reads measured by the store's facade
        assert all(plugin.get_blocking(k) is not None for k in keys)
    read_s = 4 * math.prod(SHAPE) * 2 / plugin.backend.read_rate.figures()["bytes_per_s"]
    per_chunk_s = read_s / 4
    outcomes = {}
    for label, factor in (("slow_engine", 10.0), ("fast_engine", 0.1)):
        tokens_per_s = 256 / (per_chunk_s * factor)
        manager = managers(**{"storage_plugin.kvcore.prefill_tokens_per_s": tokens_per_s})
        reader = plugin_of(manager)
        for _ in range(3):
            assert all(reader.get_blocking(k) is not None for k in keys)
        outcomes[label] = (reader.batched_contains(keys), reader.report_status())
    assert outcomes["slow_engine"][0] == 4
    found, status = outcomes["fast_engine"]
    assert found < 4 and status["chunks_declined"] == 4 - found
    assert status["decide.loads_declined"] >= 1


def test_a_chunks_tenant_is_its_requests_kvcore_tenant_tag(managers):
    """``lmcache.tag.kvcore_tenant`` in a request's configs names its tenant (one the settings
    know); chunks without it are the default tenant's."""
    tenants = {"tenants": {"team-a": {}}}
    manager = managers(**{"storage_plugin.kvcore.tenants": tenants})
    tagged = [key(i, request_configs={"lmcache.tag.kvcore_tenant": "team-a"}) for i in range(2)]
    put_and_wait(manager, tagged, [1, 2])
    put_and_wait(manager, [key(5)], [5])
    backend = plugin_of(manager).backend
    assert backend is not None
    stats = backend.stats()
    assert stats["tenant_blocks_done.write.team-a"] == 2
    assert stats["tenant_blocks_done.write.default"] == 1
