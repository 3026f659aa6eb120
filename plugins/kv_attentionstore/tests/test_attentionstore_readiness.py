"""Opening waits for the SDK: "not ready" is retried within the timeout, anything else fails."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from attentionstore_sdk import reference_control as control
from kv_attentionstore import SdkNotReadyError, SdkStartError

from kvcore.testing import Harness


def test_open_retries_while_not_ready(open_as: Callable[..., Harness]) -> None:
    control.faults().not_ready_calls = 3
    h = open_as()
    assert len(control.calls("match")) == 4  # three not-ready probes, then one that answers
    assert h.backend.stats()["backend_readiness_not_ready_probes"] == 3
    seq = h.new_sequence(2)
    assert h.write(seq) == 2


def test_open_gives_up_after_the_readiness_timeout(open_as: Callable[..., Harness]) -> None:
    control.faults().not_ready_calls = 10**9
    t0 = time.monotonic()
    with pytest.raises(SdkNotReadyError, match="AS_READINESS_TIMEOUT_S"):
        open_as({"readiness_timeout_s": 0.3, "readiness_poll_s": 0.02})
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 5.0  # (never ready: without the timeout the wait has no end)
    assert len(control.calls("match")) > 3


def test_slow_probes_count_against_the_readiness_timeout(
    open_as: Callable[..., Harness],
) -> None:
    # each probe takes 0.1 s and sleeps 0.2 s between: only wall time may end the wait
    control.faults().not_ready_calls = 10**9
    control.faults().delay_s = 0.1
    t0 = time.monotonic()
    with pytest.raises(SdkNotReadyError):
        open_as({"readiness_timeout_s": 0.5, "readiness_poll_s": 0.2})
    assert time.monotonic() - t0 < 1.0


def test_other_errors_fail_the_open_at_once(open_as: Callable[..., Harness]) -> None:
    control.faults().fail_ops = frozenset({"match"})
    control.faults().fail_message = "namespace unknown"
    t0 = time.monotonic()
    with pytest.raises(SdkStartError, match="namespace unknown"):
        open_as({"readiness_timeout_s": 30})
    assert time.monotonic() - t0 < 5.0  # not the readiness timeout's 30 s
    assert len(control.calls("match")) == 1


def test_sdk_constructor_failure_fails_the_open(open_as: Callable[..., Harness]) -> None:
    control.faults().fail_ops = frozenset({"init"})
    with pytest.raises(SdkStartError, match="AttentionStoreSDK"):
        open_as()


def test_the_wait_never_sleeps_past_the_readiness_timeout(
    open_as: Callable[..., Harness],
) -> None:
    control.faults().not_ready_calls = 10**9
    t0 = time.monotonic()
    with pytest.raises(SdkNotReadyError):
        open_as({"readiness_timeout_s": 0.2, "readiness_poll_s": 5.0})
    assert time.monotonic() - t0 < 2.5  # half the 5 s poll: the timeout cut the sleep
