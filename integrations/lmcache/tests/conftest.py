"""Helpers shared by kvcore-lmcache's tests: LMCache's own memory objects and keys, a way to
run one adapter task to its end through its event fd (as LMCache's controllers do), and a real
``mooncake_master`` on 127.0.0.1 (kv_mooncake's fixtures) for tier stacks over Mooncake."""

from __future__ import annotations

import os
import select
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kv_mooncake.testing import isolate_loopback

# Mooncake's client listens on the wildcard address: where we may, run in a loopback-only
# network namespace (before any thread starts), as kv_mooncake's own tests do.
_NETNS = isolate_loopback() if os.environ.get("KV_MOONCAKE_NETNS", "auto") != "0" else "disabled"

import torch  # noqa: E402
from kvcore_lmcache.l2 import KVCoreL2Adapter  # noqa: E402
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.memory_management import (  # noqa: E402
    MemoryFormat,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from lmcache.v1.platform import consume_fd  # noqa: E402


def pytest_report_header(config: pytest.Config) -> str:
    where = "private" if _NETNS is None else f"shared ({_NETNS})"
    return f"kvcore-lmcache: network namespace {where}"


def memory_obj(
    values: torch.Tensor | None = None,
    *,
    n: int = 1024,
    dtype: torch.dtype = torch.float16,
    fmt: MemoryFormat = MemoryFormat.KV_2LTD,
) -> TensorMemoryObj:
    """An LMCache memory object holding ``values`` (else ``n`` zeros of ``dtype``)."""
    data = torch.zeros(n, dtype=dtype) if values is None else values.clone()
    meta = MemoryObjMetadata(
        shape=data.shape,
        dtype=data.dtype,
        address=0,
        phy_size=data.numel() * data.element_size(),
        fmt=fmt,
        ref_count=1,
    )
    return TensorMemoryObj(data, meta, parent_allocator=None)


def random_obj(seed: int, n: int = 1024, dtype: torch.dtype = torch.float16) -> TensorMemoryObj:
    gen = torch.Generator().manual_seed(seed)
    return memory_obj(torch.randn(n, generator=gen).to(dtype))


def key(i: int, **fields: Any) -> ObjectKey:
    base: dict[str, Any] = {"model_name": "org/tiny-1.5", "kv_rank": 0}
    base.update(fields)
    return ObjectKey(chunk_hash=i.to_bytes(32, "big"), **base)


def wait_fd(fd: int, timeout: float = 10.0) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(timeout * 1000), "the adapter signalled no completion"
    consume_fd(fd)


def _result(adapter: KVCoreL2Adapter, fd: int, fetch: Callable[[], Any]) -> Any:
    for _ in range(100):
        wait_fd(fd)
        got = fetch()
        if got is not None:
            return got
    raise AssertionError("the task never completed")


def store(adapter: KVCoreL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> Any:
    task = adapter.submit_store_task(keys, objs)
    return _result(
        adapter, adapter.get_store_event_fd(), lambda: adapter.pop_completed_store_tasks().get(task)
    )


def lookup(adapter: KVCoreL2Adapter, keys: list[ObjectKey]) -> list[int]:
    task = adapter.submit_lookup_and_lock_task(keys, {})
    found = _result(
        adapter,
        adapter.get_lookup_and_lock_event_fd(),
        lambda: adapter.query_lookup_and_lock_result(task),
    )
    return found.get_indices_list()


def load(adapter: KVCoreL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> list[int]:
    task = adapter.submit_load_task(keys, objs)
    done = _result(adapter, adapter.get_load_event_fd(), lambda: adapter.query_load_result(task))
    return done.get_indices_list()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def open_adapter(root: Path) -> Iterator[Callable[..., KVCoreL2Adapter]]:
    """Adapters over kv_file at ``root`` (closed after the test)."""
    made: list[KVCoreL2Adapter] = []

    def make(**params: Any) -> KVCoreL2Adapter:
        params.setdefault("backend", "file")
        params.setdefault("backend_config", {"root": str(root)})
        adapter = KVCoreL2Adapter(params)
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        adapter.close()


@pytest.fixture
def no_meta_backend(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> str:
    """The name of an installed backend that keeps no block metadata: kvcore's ``memory``
    backend without the capability, published by a throwaway distribution's entry point (every
    backend shipped with kvcore keeps block metadata, a third party's may not)."""
    site = tmp_path_factory.mktemp("site")
    (site / "kvcore_lmcache_nometa.py").write_text(
        "from kvcore.memory_backend import MemoryBackend\n\n\n"
        "class NoMetaBackend(MemoryBackend):\n"
        "    capabilities = MemoryBackend.capabilities.model_copy(update={'block_meta': False})\n"
    )
    info = site / "kvcore_lmcache_nometa-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvcore-lmcache-nometa\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[kvcore.backends]\nlmcache-test-no-meta = kvcore_lmcache_nometa:NoMetaBackend\n"
    )
    monkeypatch.syspath_prepend(str(site))
    return "lmcache-test-no-meta"
