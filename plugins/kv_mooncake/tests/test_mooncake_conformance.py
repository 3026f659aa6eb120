"""The kvcore conformance kit against a live mooncake_master on loopback."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.testing import BackendConformance


class TestMooncakeBackend(BackendConformance):
    backend = "mooncake"

    @pytest.fixture
    def backend_config(self, mooncake_config: dict[str, Any]) -> dict[str, Any]:
        return mooncake_config
