"""Stacks with a Mooncake tier run their master on loopback only, in a private network
namespace when we can (as kv_mooncake's own tests do). Set KV_MOONCAKE_NETNS=0 to skip it."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("KV_MOONCAKE_NETNS", "auto") == "0":
        return
    try:
        from kv_mooncake.testing import isolate_loopback
    except ImportError:  # no Mooncake tier can run: nothing to isolate
        return
    isolate_loopback()  # a no-op, with a reason, when kv_mooncake's conftest did it first
