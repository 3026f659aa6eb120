"""The kvcore conformance kit against the installed ``file`` backend, under every fsync policy."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.testing import BackendConformance


class TestFileConformance(BackendConformance):
    backend = "file"

    @pytest.fixture
    def backend_config(self, tmp_path) -> dict[str, Any]:
        return {"root": str(tmp_path / "store")}


class TestFileConformanceDurable(TestFileConformance):
    """The same contract with every sync on (slower, so one class is enough)."""

    @pytest.fixture
    def backend_config(self, tmp_path) -> dict[str, Any]:
        return {"root": str(tmp_path / "store"), "fsync": "data_and_dir", "io_threads": 2}
