"""Stacks with a Mooncake tier run their master on loopback only, in a private network
namespace when we can (as kv_mooncake's own tests do). Set KV_MOONCAKE_NETNS=0 to skip it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kvcore


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("KV_MOONCAKE_NETNS", "auto") == "0":
        return
    try:
        from kv_mooncake.testing import isolate_loopback
    except ImportError:  # no Mooncake tier can run: nothing to isolate
        return
    isolate_loopback()  # a no-op, with a reason, when kv_mooncake's conftest did it first


#: what a small kv_file store counts for its own files (ledger, journal) on top of its objects
KV_FILE_OWN_BYTES = 32 << 10


@pytest.fixture
def open_evicting_stack(tmp_path: Path) -> Callable[..., kvcore.Backend]:
    """Opens a ``write-back-on-evict`` stack whose near tier (kv_file, under ``tmp_path``)
    holds about ``near_blocks`` blocks of ``layout`` and evicts one object at a time (both
    watermarks 1.0), over ``below`` (default: a kv_file tier of its own). The caller closes
    it. One place for the stack the eviction hand-down tests share."""

    def open_(
        layout: kvcore.CacheLayout, *, near_blocks: int = 10, below: dict[str, Any] | None = None
    ) -> kvcore.Backend:
        block = 2 * layout.part_bytes("k")
        near = {"backend": "file", "root": str(tmp_path / "near"),
                "capacity_bytes": near_blocks * block + KV_FILE_OWN_BYTES,
                "high_watermark": 1.0, "low_watermark": 1.0, "rescan_interval_s": 0}  # fmt: skip
        far = below or {"backend": "file", "root": str(tmp_path / "far"), "rescan_interval_s": 0}
        return kvcore.open_backend(
            "tiered",
            {"tiers": [near, far], "write_policy": "write-back-on-evict"},
            context={"layout": layout},
            strict=True,
        )

    return open_
