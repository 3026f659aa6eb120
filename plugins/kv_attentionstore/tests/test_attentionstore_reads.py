"""Query and read: what reaches the SDK, and how its answers and failures come back."""

from __future__ import annotations

import dataclasses
import time

from attentionstore_sdk import reference_control as control

from kvcore.testing import Harness, blocks_equal


def test_read_passes_layers_tokens_start_pointers_and_block_ids(harness: Harness) -> None:
    bs = harness.layout.block_size
    seq = harness.new_sequence(8)
    assert harness.write(seq) == 8

    done, got = harness.read(seq, 2, 3)

    assert done == 3
    assert blocks_equal(got, harness.payload(seq, 2, 3)) == []
    _, block_ids = harness.last_device
    (call,) = control.calls("read")
    assert call.start_block_idx == 2
    assert call.token_ids == tuple(seq.token_ids[: 5 * bs]), "only the tokens the read covers"
    assert call.layer_ids == tuple(range(harness.layout.total_layers))
    assert call.gpu_block_ids == tuple(block_ids)
    assert call.kwargs == {"remote_addrs": None}, "FastDeploy's K/V-size SDK read (lines 155-164)"


def test_older_sdk_read_gets_no_keywords(per_block_sdk: None, harness: Harness) -> None:
    seq = harness.new_sequence(3)
    assert harness.write(seq) == 3
    assert harness.read(seq)[0] == 3
    (call,) = control.calls("read")
    assert call.kwargs == {}, "FastDeploy's other read (lines 166-174)"


def test_query_starts_at_the_request_start(harness: Harness) -> None:
    seq = harness.new_sequence(6)
    assert harness.write(seq, 0, 4) == 4
    assert harness.query(seq, 1, 5) == 3
    assert control.calls("match")[-1].start_block_idx == 1


def test_request_past_the_tokens_counts_only_full_blocks(harness: Harness) -> None:
    half = harness.layout.block_size // 2
    seq = harness.new_sequence(3, extra_tokens=half)
    assert harness.write(seq) == 3
    backend = harness.backend
    keys = [*seq.keys, "block-without-tokens"]
    buffers, _ = harness._empty_buffers(4)
    request = backend.request("past", keys, token_ids=seq.token_ids, **buffers)
    assert backend.query(request) == 3
    assert backend.read(request) == 3
    assert len(control.calls("read")[-1].gpu_block_ids) == 3


def test_sdk_answers_are_clamped_to_the_request(harness: Harness) -> None:
    seq = harness.new_sequence(2)
    client = harness.backend.plugin._client
    client.match = lambda tokens, start, timeout: 99
    assert harness.query(seq) == 2
    client.match = lambda tokens, start, timeout: -3
    assert harness.query(seq) == 0


def test_non_integer_sdk_answer_is_a_counted_miss(harness: Harness) -> None:
    seq = harness.new_sequence(2)
    harness.backend.plugin._client.match = lambda tokens, start, timeout: "2"
    assert harness.query(seq) == 0
    assert harness.backend.stats()["backend_query_bad_results"] == 1


def test_sdk_match_error_is_a_counted_query_miss(harness: Harness) -> None:
    seq = harness.new_sequence(3)
    assert harness.write(seq) == 3
    control.faults().fail_ops = frozenset({"match"})
    got = harness.backend.query(harness.request(seq))
    assert got == 0  # strict mode: nothing was raised
    assert got.failure is not None and "injected" in got.failure, "a failure, not an absence"
    assert harness.backend.stats()["backend_query_sdk_errors"] == 1


def test_sdk_read_error_is_a_counted_read_miss(harness: Harness) -> None:
    seq = harness.new_sequence(3)
    assert harness.write(seq) == 3
    control.faults().fail_ops = frozenset({"read"})
    assert harness.read(seq)[0] == 0
    assert harness.backend.stats()["backend_read_sdk_errors"] == 1
    assert harness.query(seq) == 3, "a failed read must not hide stored blocks"


def test_not_ready_after_open_is_a_miss_not_an_error(harness: Harness) -> None:
    seq = harness.new_sequence(2)
    assert harness.write(seq) == 2
    control.faults().not_ready_calls = 1
    assert harness.query(seq) == 0
    assert harness.query(seq) == 2


def test_slow_read_returns_by_the_deadline(harness: Harness) -> None:
    seq = harness.new_sequence(2)
    assert harness.write(seq) == 2
    control.faults().delay_s = 30
    t0 = time.monotonic()
    assert harness.read(seq, timeout_s=0.2)[0] == 0
    assert time.monotonic() - t0 < 5.0  # far from the SDK's 30 s, whatever else the machine runs


def test_expired_deadline_makes_no_sdk_call(harness: Harness) -> None:
    seq = harness.new_sequence(2)
    request = harness.request(seq, timeout_s=1e-9)
    time.sleep(0.01)
    assert harness.backend.query(request) == 0
    assert control.calls("match")[-1].op == "match"  # only the readiness probe
    assert len(control.calls("match")) == 1
    assert harness.backend.stats()["backend_query_deadline_expired"] == 1


def test_a_request_without_token_ids_covers_no_block(harness: Harness) -> None:
    seq = harness.new_sequence(1)
    assert harness.write(seq) == 1
    request = dataclasses.replace(harness.request(seq), token_ids=None)
    assert harness.backend.query(request) == 0
    assert len(control.calls("match")) == 2, "the readiness probe and the write's match only"
