"""Shared fixtures of the kv_file tests."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.testing import small_layout


@pytest.fixture
def store_config(tmp_path) -> dict[str, Any]:
    """A private root and no background rescans (tests call rescan() when they mean to)."""
    return {"root": str(tmp_path / "store"), "rescan_interval_s": 0}


@pytest.fixture
def layout():
    return small_layout()
