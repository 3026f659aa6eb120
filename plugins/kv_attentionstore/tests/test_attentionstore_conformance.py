"""The kvcore conformance kit, run against the backend on the reference SDK."""

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
            "write_slice_blocks": 3,
            "pod_name": "pod-b",
            "splitwise_role": "decode",
        }

    @pytest.fixture
    def backend_context(self) -> dict[str, Any]:
        return {"rank": 1, "world_size": 2, "namespace": "conformance-shard"}
