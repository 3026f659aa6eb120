"""Fixtures: SGLang's real host pools on CPU, storages built by SGLang's factory, and the three
kvcore backends the adapter is proven on (the in-process reference ``memory``, ``file``, and
``mooncake`` against a real ``mooncake_master`` on 127.0.0.1, from kv_mooncake's fixtures)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kv_mooncake.testing import isolate_loopback

# Mooncake's client listens on the wildcard address: where we may, run in a loopback-only
# network namespace (before any thread starts), as kv_mooncake's own tests do.
_NETNS = isolate_loopback() if os.environ.get("KV_MOONCAKE_NETNS", "auto") != "0" else "disabled"

from kvcore_sglang.testing import (  # noqa: E402
    create_storage,
    extra_config,
    prepare_cpu_sglang,
    storage_config,
)

prepare_cpu_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

#: backends whose objects outlive one opened instance (two storages can share them)
SHARED_BACKENDS = ("file", "mooncake")
ALL_BACKENDS = ("memory", *SHARED_BACKENDS)


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"kvcore-sglang: network namespace {'private' if _NETNS is None else f'shared ({_NETNS})'}"
    )


def page_keys(n: int, page_size: int = 16, seed: int = 0) -> list[str]:
    """SGLang's chained page hashes of ``n`` pages of made-up tokens."""
    tokens = [(seed * 7919 + i) % 50_000 for i in range(n * page_size)]
    return get_hash_str(tokens, None, page_size=page_size)


def page_indices(pool: Any, first_page: int, n: int) -> torch.Tensor:
    """Host slots of pages ``first_page .. first_page + n`` (SGLang passes every token slot)."""
    p = pool.page_size
    return torch.arange(first_page * p, (first_page + n) * p, dtype=torch.int64)


def page_bytes(pool: Any, first_page: int, n: int) -> list[bytes]:
    """The pool's flat pages, as SGLang's get_data_page gives them."""
    return [
        bytes(
            pool.get_data_page((first_page + i) * pool.page_size)
            .contiguous()
            .view(torch.uint8)
            .numpy()
        )
        for i in range(n)
    ]


@pytest.fixture
def backend_spec(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, Any]:
    """(kvcore backend name, its config) for the parametrised backend."""
    name = request.param
    if name == "file":
        return name, {"root": str(tmp_path / "store")}
    if name == "mooncake":
        return name, request.getfixturevalue("mooncake_config")
    return name, None


@pytest.fixture
def make_storage(
    backend_spec: tuple[str, Any],
) -> Iterator[Callable[..., Any]]:
    """``make_storage(pool, **identity)``: a storage built by SGLang's factory on the
    parametrised backend, registered with ``pool``; closed at the end of the test."""
    made: list[Any] = []
    # the Mooncake cluster lives for the session: each test gets namespaces of its own
    namespace = f"t{uuid.uuid4().hex[:12]}"

    def factory(pool: Any, *, extra: dict[str, Any] | None = None, **identity: Any) -> Any:
        name, config = backend_spec
        more = {"namespace": namespace, **(extra or {})}
        extra_cfg = extra_config(name, more.pop("backend_config", config), **more)
        storage = create_storage("dynamic", storage_config(extra_cfg, **identity), pool)
        made.append(storage)
        return storage

    yield factory
    for storage in made:
        storage.close()
