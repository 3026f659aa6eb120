"""Writes: only the unmatched suffix is sent, in slices, stopping at the first short slice."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from attentionstore_sdk import reference_control as control

from kvcore.testing import Harness, blocks_equal


def _writes_since(mark: int) -> list[control.Call]:
    return control.calls("write")[mark:]


def test_write_sends_only_the_unmatched_suffix(harness: Harness) -> None:
    bs = harness.layout.block_size
    seq = harness.new_sequence(6)
    assert harness.write(seq, 0, 2) == 2
    mark = len(control.calls("write"))

    assert harness.write(seq) == 6

    _, block_ids = harness.last_device
    (call,) = _writes_since(mark)
    assert call.start_block_idx == 2
    assert call.gpu_block_ids == tuple(block_ids[2:])
    assert call.token_ids == tuple(seq.token_ids[: 6 * bs])
    assert harness.backend.stats()["backend_write_skipped_blocks"] == 2
    assert call.kwargs == {"h2h_copy": False, "params": None}, "FastDeploy lines 201-211"
    done, got = harness.read(seq)
    assert done == 6
    assert blocks_equal(got, harness.payload(seq, 0, 6)) == []


def test_fully_stored_write_calls_no_sdk_write(harness: Harness) -> None:
    seq = harness.new_sequence(4)
    assert harness.write(seq) == 4
    mark = len(control.calls("write"))
    assert harness.write(seq) == 4
    assert _writes_since(mark) == []


def test_write_from_a_start_block_uses_only_the_tokens_it_covers(harness: Harness) -> None:
    bs = harness.layout.block_size
    seq = harness.new_sequence(8)  # the token path runs three blocks past the request
    assert harness.write(seq, 0, 3) == 3
    mark = len(control.calls("write"))

    assert harness.write(seq, 3, 2) == 2

    (call,) = _writes_since(mark)
    assert call.start_block_idx == 3
    assert len(call.gpu_block_ids) == 2
    assert call.token_ids == tuple(seq.token_ids[: 5 * bs])
    match = control.calls("match")[-1]
    assert match.start_block_idx == 3
    assert harness.query(seq) == 5, "blocks past the request must not have been stored"


def test_write_is_sliced(open_as: Callable[..., Harness]) -> None:
    h = open_as({"write_slice_block_num": 2})
    bs = h.layout.block_size
    seq = h.new_sequence(5)

    assert h.write(seq) == 5

    _, block_ids = h.last_device
    calls = control.calls("write")
    assert [c.start_block_idx for c in calls] == [0, 2, 4]
    assert [c.gpu_block_ids for c in calls] == [
        tuple(block_ids[0:2]),
        tuple(block_ids[2:4]),
        tuple(block_ids[4:5]),
    ]
    assert [len(c.token_ids) for c in calls] == [2 * bs, 4 * bs, 5 * bs]
    assert h.backend.stats()["backend_write_slices"] == 3
    done, got = h.read(seq)
    assert done == 5
    assert blocks_equal(got, h.payload(seq, 0, 5)) == []


def test_write_stops_at_the_first_short_slice(open_as: Callable[..., Harness]) -> None:
    h = open_as({"write_slice_block_num": 2})
    seq = h.new_sequence(6)
    control.faults().write_block_budget = 3  # the second slice stores one of its two blocks

    assert h.write(seq) == 3

    calls = control.calls("write")
    assert [(c.start_block_idx, c.result) for c in calls] == [(0, 2), (2, 1)]
    assert h.backend.stats()["backend_write_short_slices"] == 1
    assert h.query(seq) == 3

    control.faults().write_block_budget = None  # space again: the retry resumes at block 3
    assert h.write(seq) == 6
    assert control.calls("write")[-2].start_block_idx == 3
    assert h.query(seq) == 6


def test_failed_write_is_a_counted_miss(harness: Harness) -> None:
    seq = harness.new_sequence(3)
    control.faults().fail_ops = frozenset({"write"})
    assert harness.write(seq) == 0  # strict mode: nothing was raised
    assert harness.backend.stats()["backend_write_sdk_errors"] == 1
    assert harness.query(seq) == 0


def test_failed_match_writes_nothing(harness: Harness) -> None:
    seq = harness.new_sequence(3)
    control.faults().fail_ops = frozenset({"match"})
    assert harness.write(seq) == 0
    assert control.calls("write") == []
    assert harness.backend.stats()["backend_write_match_sdk_errors"] == 1


def test_slice_timeout_caps_each_sdk_write(open_as: Callable[..., Harness]) -> None:
    h = open_as({"write_slice_timeout": 0.5, "write_slice_block_num": 2})
    seq = h.new_sequence(4)
    assert h.write(seq, timeout_s=30) == 4
    assert [c.timeout <= 0.5 for c in control.calls("write")] == [True, True]


def test_request_deadline_caps_the_slice_timeout(open_as: Callable[..., Harness]) -> None:
    h = open_as({"write_slice_timeout": 60})
    seq = h.new_sequence(2)
    assert h.write(seq, timeout_s=3) == 2
    (call,) = control.calls("write")
    assert 0 < call.timeout <= 3


def test_slow_sdk_write_returns_by_the_deadline(harness: Harness) -> None:
    seq = harness.new_sequence(4)
    control.faults().delay_s = 30
    t0 = time.monotonic()
    assert harness.write(seq, timeout_s=0.2) == 0
    assert time.monotonic() - t0 < 5.0  # far from the SDK's 30 s, whatever else the machine runs
    control.faults().delay_s = 0
    assert harness.query(seq) == 0


def test_fastdeploys_defaults_cut_slices_of_100_blocks(
    open_as: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """AS_WRITE_SLICE_BLOCK_NUM (100) and AS_WRITE_SLICE_TIMEOUT (10 s) by default."""
    h = open_as()
    assert (h.backend.config.write_slice_block_num, h.backend.config.write_slice_timeout) == (
        100,
        10.0,
    )
    monkeypatch.setenv("AS_WRITE_SLICE_BLOCK_NUM", "4")
    monkeypatch.setenv("AS_WRITE_SLICE_TIMEOUT", "0.75")
    h = open_as()
    seq = h.new_sequence(9)
    assert h.write(seq, timeout_s=30) == 9
    calls = control.calls("write")
    assert [len(c.gpu_block_ids) for c in calls] == [4, 4, 1]
    assert [c.timeout for c in calls] == [0.75, 0.75, 0.75]


def test_total_write_timeout_ends_the_slices(
    open_as: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """AS_WRITE_TOTAL_TIMEOUT caps the whole write even when the request allows more."""
    monkeypatch.setenv("AS_WRITE_TOTAL_TIMEOUT", "0.3")
    h = open_as({"write_slice_block_num": 1})
    seq = h.new_sequence(6)
    control.faults().delay_s = 0.12  # each slice takes 0.12 s: the third or fourth runs out
    done = h.write(seq, timeout_s=30)
    assert 1 <= done < 6
    assert done.failure is not None, "stopped by the cap: a failure, not an absence"
    writes = control.calls("write")
    assert all(c.timeout <= 0.3 for c in writes), "every slice's timeout is within the cap"
    assert len(writes) <= done + 1, "nothing after the slice that ran out of time"


def test_older_sdk_write_gets_no_keywords(per_block_sdk: None, harness: Harness) -> None:
    seq = harness.new_sequence(2)
    assert harness.write(seq) == 2
    (call,) = control.calls("write")
    assert call.kwargs == {}, "FastDeploy lines 213-221"


def test_only_flush_stores_nothing_and_records_residency(
    open_as: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """FD_AS_ONLY_FLUSH=1: AttentionStore is an index; a write only says 'in this device'."""
    monkeypatch.setenv("FD_AS_ONLY_FLUSH", "1")
    h = open_as()
    seq = h.new_sequence(3)
    assert h.write(seq) == 0
    assert control.calls("write") == []
    (flush,) = control.calls("flush_token_index")
    assert (flush.start_block_idx, flush.reside_in_gpu) == (0, True)
    assert h.backend.stats()["backend_write_only_flush"] == 1
