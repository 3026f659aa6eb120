"""Run this plugin's tests inside a loopback-only network namespace when we can.

Mooncake's client listens on the wildcard address whatever MC_TCP_BIND_ADDRESS says; in a
private namespace that wildcard is loopback only. Set KV_MOONCAKE_NETNS=0 to skip it.
"""

from __future__ import annotations

import os

import pytest
from kv_mooncake.testing import isolate_loopback

_netns_note = "not attempted (KV_MOONCAKE_NETNS=0)"


def pytest_configure(config: pytest.Config) -> None:
    global _netns_note
    if os.environ.get("KV_MOONCAKE_NETNS", "auto") != "0":
        why_not = isolate_loopback()
        _netns_note = "private, loopback only" if why_not is None else f"shared ({why_not})"


def pytest_report_header(config: pytest.Config) -> str:
    return f"kv_mooncake network namespace: {_netns_note}"
