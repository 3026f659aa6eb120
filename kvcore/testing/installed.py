"""Conformance tests for the backend named by ``--kvcore-backend`` (see the pytest plugin)."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.testing.plugin import load_config_arg
from kvcore.testing.suite import BackendConformance


class TestInstalledBackend(BackendConformance):
    @pytest.fixture
    def backend_target(self, pytestconfig: pytest.Config) -> str:
        name = pytestconfig.getoption("kvcore_backend")
        if not name:
            pytest.skip("run with --kvcore-backend NAME")
        return name

    @pytest.fixture
    def backend_config(self, pytestconfig: pytest.Config) -> dict[str, Any]:
        return load_config_arg(pytestconfig.getoption("kvcore_config"))
