"""SGLang's own StorageBackendFactory builds the storage from the extra config; bad configs fail
the attach with the offending key named."""

from __future__ import annotations

import logging
import re

import pytest
from kvcore_sglang import EXTRA_CONFIG
from kvcore_sglang.settings import StorageSettings, safe_namespace
from kvcore_sglang.storage import KVCoreHiCacheStorage
from kvcore_sglang.testing import create_storage, extra_config, mha_host_pool, storage_config
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage import StorageBackendFactory

import kvcore


def test_the_dynamic_backend_builds_the_kvcore_storage(tmp_path) -> None:
    extra = extra_config("file", {"root": str(tmp_path)})
    storage = StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)
    try:
        assert isinstance(storage, KVCoreHiCacheStorage)
        assert isinstance(storage, HiCacheStorage)
        storage.register_mem_pool_host(mha_host_pool())
        backend = storage._kv.backend
        assert backend.name == "file"
        # the model and a digest of it and its settings, then the page format
        assert re.fullmatch(
            r"sglang-test-model\.m[0-9a-f]{16}\.mha-tm-bfloat16", backend.context.namespace
        )
        # the layout makes kvcore's part size equal to SGLang's page part
        assert backend.context.layout.part_bytes("k") == storage._kv_format.part_nbytes[0]
    finally:
        storage.close()


def test_sglang_passes_its_own_keys_through() -> None:
    settings = StorageSettings.from_extra_config(
        {
            **EXTRA_CONFIG,
            "backend": "memory",
            "prefetch_threshold": 256,
            "prefetch_timeout_base": 1,
            "hicache_storage_pass_prefix_keys": True,
            "tp_lcm_size": 4,
        }
    )
    assert settings.backend == "memory"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"backend_confg": {}}, "backend_confg"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"weight_version": "../x"}, "weight_version"),
        ({"backend_config": {"namespace": "x"}}, "backend_config.namespace"),
        ({"backend_config": {"capacity_bytez": 1}}, "capacity_bytez"),
    ],
)
def test_bad_extra_configs_name_the_key(tmp_path, extra, message) -> None:
    config = storage_config(extra_config("file", **extra))
    with pytest.raises((ValueError, kvcore.ConfigError), match=message):
        create_storage("dynamic", config, mha_host_pool())


def test_an_unknown_kvcore_backend_fails_the_attach() -> None:
    with pytest.raises(kvcore.UnknownBackendError, match="no_such_backend"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(extra_config("no_such_backend")), None
        )


def test_heterogeneous_tp_head_splitting_is_refused() -> None:
    config = storage_config(extra_config("memory"), should_split_heads=True, tp_lcm_size=4)
    with pytest.raises(NotImplementedError, match="tp_lcm_size"):
        StorageBackendFactory.create_backend("dynamic", config, None)


def test_without_interface_v1_sglang_would_copy_pages_and_we_say_so(caplog) -> None:
    extra = {k: v for k, v in extra_config("memory").items() if k != "interface_v1"}
    with caplog.at_level(logging.WARNING, logger="kvcore_sglang"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), None).close()
    assert any("interface_v1" in r.getMessage() for r in caplog.records)


def test_a_short_name_cannot_work_in_this_sglang() -> None:
    # SGLang has a registration hook, but its factory builds registered names only from a
    # hard-coded list, and picks the zero-copy I/O path only for "dynamic" with interface_v1
    # (or its own names). This test fails, on purpose, once a registered name works.
    StorageBackendFactory.register_backend("kvcore", "kvcore_sglang", "KVCoreHiCacheStorage")
    try:
        with pytest.raises(ValueError, match="Unknown built-in backend: kvcore"):
            StorageBackendFactory.create_backend(
                "kvcore", storage_config(extra_config("memory")), None
            )
    finally:
        StorageBackendFactory._registry.pop("kvcore", None)


def test_namespaces_are_safe_for_every_backend() -> None:
    assert safe_namespace("meta-llama/Llama-3.1-8B") == "meta-llama-Llama-3.1-8B"
    assert safe_namespace("../../etc") == "etc"
    long = safe_namespace("m" * 300)
    assert len(long) == 128 and long != safe_namespace("m" * 299)


@pytest.mark.parametrize("layout", ["page_unified", "page_first_kv_split"])
def test_unsupported_host_layouts_fail_the_attach(layout) -> None:
    pool = mha_host_pool("page_first")
    pool.layout = layout  # what SGLang's pools of those layouts report
    storage = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra_config("memory")), None
    )
    with pytest.raises(NotImplementedError, match=layout):
        storage.register_mem_pool_host(pool)
