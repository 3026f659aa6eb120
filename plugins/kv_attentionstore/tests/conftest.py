"""Put the reference SDK on the path and give each test a clean store and a fast backend."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REFERENCE_SDK = Path(__file__).parent / "reference_sdk"
sys.path.insert(0, str(REFERENCE_SDK))

from attentionstore_sdk import reference_control as control  # noqa: E402
from attentionstore_sdk import sdk as reference_sdk  # noqa: E402

from kvcore.testing import Harness, harness_opener  # noqa: E402

#: readiness settings that keep a not-ready simulation to fractions of a second
FAST = {"readiness_timeout_s": 2.0, "readiness_poll_s": 0.01}

#: FastDeploy's AttentionStore variables: an operator's settings must not leak into tests
FASTDEPLOY_VARS = ("ENABLE_EP_DP_IN_FD", "FD_AS_ONLY_FLUSH")


@pytest.fixture(autouse=True)
def _clean_sdk(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith("AS_") or name in FASTDEPLOY_VARS:
            monkeypatch.delenv(name)
    control.reset()
    yield
    control.reset()


def install_per_block_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Play an SDK of the older generation: the one-size constructor, no ``client.client``."""
    monkeypatch.setattr(
        reference_sdk, "AttentionStoreSDK", reference_sdk.PerBlockBytesAttentionStoreSDK
    )
    monkeypatch.setitem(sys.modules, "attentionstore_sdk.client.client", None)


@pytest.fixture
def per_block_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    install_per_block_sdk(monkeypatch)


@pytest.fixture
def fast_config() -> dict[str, Any]:
    return dict(FAST)


@pytest.fixture
def open_as() -> Iterator[Callable[..., Harness]]:
    """Open the backend (strict) on a small layout; returns a conformance-kit harness."""
    with harness_opener("attentionstore", FAST) as open_:
        yield open_


@pytest.fixture
def harness(open_as: Callable[..., Harness]) -> Harness:
    return open_as()
