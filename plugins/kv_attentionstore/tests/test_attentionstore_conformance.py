"""The kvcore conformance kit, run against the backend on the reference SDK.

Three runs: the current SDK generation (K and V sizes, FastDeploy's CUDA calls), a sharded
decode pod cutting writes into 3-block slices, and the older one-size-constructor generation.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.testing import BackendConformance


class TestAttentionStoreConformance(BackendConformance):
    backend = "attentionstore"

    @pytest.fixture
    def backend_config(self, fast_config: dict[str, Any]) -> dict[str, Any]:
        return fast_config


class TestAttentionStoreConformanceShardedWithSmallSlices(BackendConformance):
    """A non-zero TP shard, and writes cut into 3-block slices (the large batch spans many)."""

    backend = "attentionstore"

    @pytest.fixture
    def backend_config(self, fast_config: dict[str, Any]) -> dict[str, Any]:
        return {
            **fast_config,
            "write_slice_block_num": 3,
            "pod_name": "pod-b",
            "splitwise_role": "decode",
            "dp_id": 1,
        }

    @pytest.fixture
    def backend_context(self) -> dict[str, Any]:
        return {"rank": 1, "world_size": 2, "namespace": "conformance-shard"}


class TestAttentionStoreConformancePerBlockBytesSdk(BackendConformance):
    """An SDK with the older constructor (one size per layer block) and plain read/write."""

    backend = "attentionstore"

    @pytest.fixture(autouse=True)
    def _older_sdk(self, per_block_sdk: None) -> None:
        """conftest's ``per_block_sdk`` plays the older SDK (a fixture, not an import of
        ``conftest``: several test directories' conftest modules share that name)."""

    @pytest.fixture
    def backend_config(self, fast_config: dict[str, Any]) -> dict[str, Any]:
        return fast_config
