"""Fixtures: a clean environment, stores opened as the patched transfer manager opens them,
and (from kvcore-mooncake's pytest plugin) a real ``mooncake_master`` on 127.0.0.1.

Mooncake's client listens on the wildcard address whatever MC_TCP_BIND_ADDRESS says; as in
kv_mooncake's own tests, the run moves into a loopback-only network namespace when it can
(root). Set KV_MOONCAKE_NETNS=0 to skip that.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kv_mooncake.testing import MooncakeCluster, isolate_loopback

sys.path.insert(0, str(Path(__file__).parent))

from kvcore_fastdeploy import KVCoreStore

#: variables FastDeploy's stores or kvcore's backends read: none may leak in from the host
_PREFIXES = (
    "MOONCAKE_",
    "KVCORE_FILE_",
    "KVCORE_MOONCAKE_",
    "KVCORE_MEMORY_",
    "KVCORE_FASTDEPLOY_",
)
_NAMES = ("FILE_BACKEND_STORAGE_DIR", "FD_AS_ONLY_FLUSH")

_netns_note = "not attempted (KV_MOONCAKE_NETNS=0)"


def pytest_configure(config: pytest.Config) -> None:
    global _netns_note
    if os.environ.get("KV_MOONCAKE_NETNS", "auto") != "0":
        why_not = isolate_loopback()
        _netns_note = "private, loopback only" if why_not is None else f"shared ({why_not})"


def pytest_report_header(config: pytest.Config) -> str:
    return f"kvcore-fastdeploy mooncake network namespace: {_netns_note}"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(_PREFIXES) or name in _NAMES:
            monkeypatch.delenv(name)


def point_at_cluster(monkeypatch: pytest.MonkeyPatch, cluster: MooncakeCluster) -> None:
    """FastDeploy's Mooncake variables for a client of ``cluster`` that stores nothing itself
    (objects land in the cluster's long-lived storage node)."""
    for var, value in {
        "MOONCAKE_MASTER_SERVER_ADDR": cluster.master.address,
        "MOONCAKE_METADATA_SERVER": "P2PHANDSHAKE",
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0",
        "MOONCAKE_LOCAL_BUFFER_SIZE": str(16 << 20),
    }.items():
        monkeypatch.setenv(var, value)


#: the cache the flow tests use: 2 main layers + 1 MTP layer, 2 heads, 16-token blocks
CACHE = {"key_cache_shape": [24, 2, 16, 32], "num_layers": 2, "num_extra_layers": 1}


@pytest.fixture
def open_store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., KVCoreStore]]:
    """``open_store(backend, cache_dtype=..., tp_rank=..., ...)``: ``KVCoreStore.open`` with the
    arguments the patched transfer manager passes, FastDeploy's environment pointing at a
    temporary directory (file) or a real loopback master (mooncake)."""
    opened: list[KVCoreStore] = []

    def open_(backend: str, **overrides: Any) -> KVCoreStore:
        if backend == "file":
            monkeypatch.setenv("FILE_BACKEND_STORAGE_DIR", str(tmp_path / "fd-store"))
        elif backend == "mooncake":
            point_at_cluster(monkeypatch, request.getfixturevalue("mooncake_cluster"))
        kwargs: dict[str, Any] = {
            "namespace": "ERNIE-4.5-0.3B-Paddle",
            "tp_rank": 0,
            "tp_size": 1,
            "device_id": 0,
            "cache_dtype": "bfloat16",
            **CACHE,
            **overrides,
        }
        store = KVCoreStore.open(f"kvcore:{backend}", **kwargs)
        opened.append(store)
        return store

    yield open_
    for store in reversed(opened):
        store.close()
