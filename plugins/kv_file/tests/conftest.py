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


@pytest.fixture(params=["native", "python"])
def io_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test that uses it runs twice: objects read and written through kvcore's native I/O
    (``kvcore.fileio``, the default) and through kv_file's Python path (the fallback), which
    must give the same outcomes byte for byte. Child processes follow the environment."""
    from kv_file import objio

    native = request.param == "native"
    monkeypatch.setattr(objio, "native_io", native)
    monkeypatch.setenv(objio.NATIVE_IO_ENV, "1" if native else "0")
    return str(request.param)
