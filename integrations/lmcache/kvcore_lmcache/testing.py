"""LMCache's own tests of its extension points, run against kvcore's adapter and plugin.

A pytest plugin (``pytest -p kvcore_lmcache.testing``) for LMCache's test files as they ship
in its sdist: LMCache tests its L2 contract on ``MockL2Adapter`` (an in-memory store); this
plugin puts the kvcore adapter in its place before the test files import it, so every test
that builds the mock builds :class:`StandInAdapter` instead, through LMCache's own ``plugin``
adapter loader (the path ``lmcache server --l2-adapter`` takes), over a kv_file store in a
fresh directory. Nothing in the test files is changed.

- ``MockL2AdapterConfig(max_size_gb=..., mock_bandwidth_gb=...)`` builds LMCache's
  ``PluginL2AdapterConfig`` naming :class:`StandInAdapter` (``max_size_gb`` becomes the
  capacity LMCache's eviction sees; the bandwidth is the mock's own simulation, ignored);
- ``MockL2Adapter(config)`` is :class:`StandInAdapter`, the kvcore adapter taking that config
  (with the mock's ``debug_*`` introspection the tests call, answered from the store's own
  listing);
- the storage-manager suite skips itself when LMCache's device reports no runtime; it runs on
  CPU, so the plugin reports the CPU runtime available;
- LMCache's storage-plugin tests load their ``MockStoragePlugin`` by the test module's own path:
  the kvcore in-process plugin takes that name there (recording LMCache's calls in
  ``call_history`` as the mock does; its ``storage`` a view of the store by chunk hash, for the
  engine's own keys, written and read through);
- :data:`LEFT_OUT` lists the upstream tests that test the mock itself, not the contract, each
  with why; they are deselected, and the list is printed in the run's header.

Settings (environment): ``KVCORE_LMCACHE_UPSTREAM_BACKEND``: the kvcore backend (default
``file``), or ``lmcache-mock`` to run the same tests on LMCache's own mock (the baseline).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest

__all__ = ["LEFT_OUT", "stand_in_config"]  # and StandInAdapter, built on first use

#: Upstream tests not run against the kvcore adapter, by node id suffix, and why.
LEFT_OUT: dict[str, str] = {
    "test_storage_plugin.py::TestCreateDynamicBackends::test_dynamic_backend_get_blocking_"
    "called_via_storage_manager": (
        "asserts the object returned is the very Python object put in (`result is "
        "test_memory_obj`): a store returns the bytes in a buffer of its own (the same bytes "
        "are checked by tests/test_storage_plugin.py)"
    ),
    "test_mock_l2_adapter.py::TestBandwidthSimulation::test_store_completion_is_delayed_by_"
    "bandwidth": "tests the mock's simulated bandwidth (a sleep), not the L2 contract",
    "test_l2_adapter_factory.py::TestFactoryRegistry::test_mock_factory_is_registered": (
        "asserts the mock config's registered type name is 'mock'; the stand-in config is "
        "LMCache's 'plugin' type (the kvcore adapter is loaded as a plugin)"
    ),
}

_dirs: list[str] = []
_PLUGIN: dict[str, type] = {}


def _backend_config() -> tuple[str, dict[str, Any]]:
    backend = os.environ.get("KVCORE_LMCACHE_UPSTREAM_BACKEND", "file")
    if backend == "file":
        root = tempfile.mkdtemp(prefix="kvcore-lmcache-upstream-")
        _dirs.append(root)
        return backend, {"root": root}
    return backend, {}


def stand_in_config(max_size_gb: float = 0.0, mock_bandwidth_gb: float = 0.0, **_: Any) -> Any:
    """What ``MockL2AdapterConfig(...)`` builds under this plugin: LMCache's plugin config
    naming the kvcore adapter over a fresh store."""
    from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

    backend, backend_config = _backend_config()
    return PluginL2AdapterConfig(
        module_path=__name__,
        class_name="StandInAdapter",
        adapter_params={
            "backend": backend,
            "backend_config": backend_config,
            "max_capacity_bytes": int(max_size_gb * 1024**3),
            "seed_usage": False,
        },
    )


def _stand_in_class() -> type:
    from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

    from kvcore_lmcache.l2 import KVCoreL2Adapter, KVCoreL2AdapterConfig

    class StandInAdapter(KVCoreL2Adapter):
        """The kvcore adapter, also taking the plugin config :func:`stand_in_config` builds
        (what a test passes to ``MockL2Adapter(config)``)."""

        def __init__(self, config: Any = None, l1_memory_desc: Any = None) -> None:
            if isinstance(config, PluginL2AdapterConfig):
                config = KVCoreL2AdapterConfig.from_dict(config.adapter_params)
            super().__init__(config, l1_memory_desc)

        # the mock's introspection that LMCache's tests call, answered by the store itself

        def debug_has_key(self, key: Any) -> bool:
            return any(k == key for _, k in self._listed_keys())

        def debug_get_stored_object_count(self) -> int:
            return len(self._listed_keys())

        def debug_get_locked_key_count(self) -> int:
            with self._lock:
                return len(self._locks)

    StandInAdapter.__module__ = __name__
    return StandInAdapter


def _stand_in_plugin_class() -> type:
    from lmcache.utils import CacheEngineKey

    from kvcore_lmcache.plugin import KVCoreStoragePlugin
    from kvcore_lmcache.settings import AdapterSettings

    class ChunkView:
        """``plugin.storage``: the store's chunks of the engine's own keys by chunk hash (what
        LMCache's tests read and write on the mock's dict), written and read through."""

        def __init__(self, plugin: Any) -> None:
            self.plugin = plugin

        def key(self, chunk_hash: Any) -> Any:
            meta = self.plugin.metadata
            return CacheEngineKey(
                model_name=meta.model_name,
                world_size=meta.world_size,
                worker_id=meta.worker_id,
                chunk_hash=chunk_hash,
                dtype=meta.kv_dtype,
            )

        def __setitem__(self, chunk_hash: Any, obj: Any) -> None:
            futures = self.plugin.batched_submit_put_task([self.key(chunk_hash)], [obj]) or []
            for future in futures:
                future.result(timeout=30)
            assert self.plugin.contains(self.key(chunk_hash)), "the put did not store it"

        def __contains__(self, chunk_hash: Any) -> bool:
            return bool(self.plugin.contains(self.key(chunk_hash)))

        def get(self, chunk_hash: Any) -> Any:
            return self.plugin.get_blocking(self.key(chunk_hash))

    class MockStoragePlugin(KVCoreStoragePlugin):
        """The kvcore plugin under the name LMCache's tests load, over a fresh kv_file store,
        recording the calls LMCache makes (``call_history``) as the mock does."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.call_history: list[str] = []
            super().__init__(*args, **kwargs)
            self.storage = ChunkView(self)

        def _settings(self, extra: Any) -> AdapterSettings:
            backend, backend_config = _backend_config()
            return AdapterSettings(backend=backend, backend_config=backend_config)

        def contains(self, key: Any, pin: bool = False) -> bool:
            self.call_history.append(f"contains:{key.chunk_hash}")
            return super().contains(key, pin)

        def batched_contains(self, keys: list[Any], pin: bool = False) -> int:
            self.call_history.extend(f"contains:{k.chunk_hash}" for k in keys)
            return super().batched_contains(keys, pin)

        def get_blocking(self, key: Any) -> Any:
            self.call_history.append(f"get_blocking:{key.chunk_hash}")
            return super().get_blocking(key)

        def remove(self, key: Any, force: bool = True) -> bool:
            self.call_history.append(f"remove:{key.chunk_hash}")
            return super().remove(key, force)

        def close(self) -> None:
            self.call_history.append("close")
            super().close()

    MockStoragePlugin.__module__ = __name__
    return MockStoragePlugin


def __getattr__(name: str) -> Any:
    # LMCache's plugin loader does getattr(module, class_name); built lazily so importing
    # this module (as a pytest plugin) imports LMCache only when a test needs it
    if name == "StandInAdapter":
        cls = _stand_in_class()
        globals()[name] = cls
        return cls
    if name == "KVCoreL2AdapterConfig":
        from kvcore_lmcache.l2 import KVCoreL2AdapterConfig

        return KVCoreL2AdapterConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pytest_configure(config: pytest.Config) -> None:
    import lmcache
    from lmcache.v1.distributed.l2_adapters import mock_l2_adapter

    if os.environ.get("KVCORE_LMCACHE_UPSTREAM_BACKEND") != "lmcache-mock":
        mock_l2_adapter.MockL2AdapterConfig = stand_in_config
        mock_l2_adapter.MockL2Adapter = __getattr__("StandInAdapter")
    device = lmcache.torch_dev
    if not device.is_available():
        # LMCache's CPU stand-in device: the suites that skip on it run on CPU
        type(device).is_available = lambda self: True


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = ["kvcore_lmcache.testing: LMCache's MockL2Adapter is the kvcore adapter; left out:"]
    lines += [f"  {test}: {why}" for test, why in LEFT_OUT.items()]
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # LMCache's storage-plugin tests load their mock by the test module's path and class name:
    # the kvcore plugin takes that name in the test module itself
    if os.environ.get("KVCORE_LMCACHE_UPSTREAM_BACKEND") != "lmcache-mock":
        for item in items:
            module = getattr(item, "module", None)
            if module is None or not module.__name__.endswith("test_storage_plugin"):
                continue
            if getattr(module, "MockStoragePlugin", None) is not _PLUGIN.get("cls"):
                _PLUGIN["cls"] = _PLUGIN.get("cls") or _stand_in_plugin_class()
                module.MockStoragePlugin = _PLUGIN["cls"]
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (dropped if any(item.nodeid.endswith(t) for t in LEFT_OUT) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_unconfigure(config: pytest.Config) -> None:
    for root in _dirs:
        shutil.rmtree(root, ignore_errors=True)
