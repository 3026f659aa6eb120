"""The conformance kit on tier stacks: memory over file, file over a real Mooncake cluster (a
master and a storage node on 127.0.0.1), and file over file handing down what it evicts.
(A file-over-file write-through stack's behaviours are tested in test_tiered_stack.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.testing import BackendConformance


class TestMemoryOverFile(BackendConformance):
    backend = "tiered"

    @pytest.fixture
    def backend_config(self, tmp_path) -> dict[str, Any]:
        return {"tiers": [{"backend": "memory"}, {"backend": "file", "root": str(tmp_path / "s")}]}


class TestFileOverMooncake(BackendConformance):
    backend = "tiered"

    @pytest.fixture
    def backend_config(self, tmp_path, request) -> dict[str, Any]:
        pytest.importorskip("kv_mooncake.testing", reason="kv_mooncake is not installed")
        mooncake = request.getfixturevalue("mooncake_config")
        return {
            "tiers": [
                {"backend": "file", "root": str(tmp_path / "near")},
                {"backend": "mooncake", "config": mooncake},
            ]
        }


class TestFileOverFileWriteBackOnEvict(BackendConformance):
    """The lower tier receives only what the upper one evicts."""

    backend = "tiered"

    @pytest.fixture
    def backend_config(self, tmp_path) -> dict[str, Any]:
        return {
            "tiers": [
                {"backend": "file", "root": str(tmp_path / "near"), "capacity_bytes": 8 << 20},
                {"backend": "file", "root": str(tmp_path / "far")},
            ],
            "write_policy": "write-back-on-evict",
        }
