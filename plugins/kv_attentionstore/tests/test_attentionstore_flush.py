"""flush_token_index: after a read (resident) and on host-cache eviction (not resident).

The transfer manager sends the full token path from the root and the first block whose
residency changed; the backend must hand the SDK exactly that path (through the request's last
block), that start index and that residency, and never touch the data.
"""

from __future__ import annotations

from attentionstore_sdk import reference_control as control
from attentionstore_sdk.api.common.common_pb2 import MEDIA_HBM
from attentionstore_sdk.sdk import Tokens

from kvcore.testing import Harness


def _resident(harness: Harness, seq, start: int, stop: int) -> list[bool | None]:
    """The reference store's residency record of blocks ``start .. stop``."""
    hashes = Tokens(seq.token_ids, harness.layout.block_size).block_hashes
    store = control.instances()[-1].store
    return [store.resident.get(h) for h in hashes[start:stop]]


def test_flush_after_read_marks_the_read_blocks_resident(harness: Harness) -> None:
    bs = harness.layout.block_size
    seq = harness.new_sequence(8)
    assert harness.write(seq) == 8
    assert harness.read(seq, 2, 3)[0] == 3

    n = harness.backend.flush_token_index(harness.request(seq, 2, 3), True)

    assert n == 3
    (call,) = control.calls("flush_token_index")
    assert call.start_block_idx == 2
    assert call.media == (None, MEDIA_HBM), "FastDeploy's resident call (lines 255-261)"
    assert call.timeout is None, "FastDeploy passes no timeout"
    assert call.reside_in_gpu is True
    assert call.token_ids == tuple(seq.token_ids[: 5 * bs]), "full path from the root"
    assert call.layer_ids == tuple(range(harness.layout.total_layers))
    assert _resident(harness, seq, 0, 8) == [None, None, True, True, True, None, None, None]
    assert harness.backend.stats()["backend_flush_resident"] == 1


def test_flush_on_eviction_uses_the_evicted_blocks_depth(harness: Harness) -> None:
    """Evicting the host-cache node at depth 4 (one block): start index 3, not resident."""
    bs = harness.layout.block_size
    seq = harness.new_sequence(6)
    assert harness.write(seq) == 6
    harness.backend.flush_token_index(harness.request(seq, 0, 6), True)

    n = harness.backend.flush_token_index(harness.request(seq, 3, 1), False)

    assert n == 1
    call = control.calls("flush_token_index")[-1]
    assert call.media == (MEDIA_HBM, None), "FastDeploy's evicted call (lines 263-268)"
    assert (call.start_block_idx, call.reside_in_gpu) == (3, False)
    assert call.token_ids == tuple(seq.token_ids[: 4 * bs])
    assert _resident(harness, seq, 0, 6) == [True, True, True, False, True, True]
    assert harness.backend.stats()["backend_flush_evicted"] == 1


def test_flush_moves_no_data(harness: Harness) -> None:
    seq = harness.new_sequence(4)
    assert harness.write(seq) == 4
    for resident in (True, False):
        harness.backend.flush_token_index(harness.request(seq), resident)
    assert harness.query(seq) == 4
    done, got = harness.read(seq)
    assert done == 4
    assert got == harness.payload(seq, 0, 4)
    assert len(control.calls("write")) == 1, "a flush must not write"


def test_flush_of_blocks_never_stored_updates_the_index_only(harness: Harness) -> None:
    seq = harness.new_sequence(3)
    assert harness.backend.flush_token_index(harness.request(seq), True) == 3
    assert harness.query(seq) == 0


def test_flush_covers_only_full_blocks(harness: Harness) -> None:
    half = harness.layout.block_size // 2
    seq = harness.new_sequence(2, extra_tokens=half)
    request = harness.backend.request("f", [*seq.keys, "partial"], token_ids=seq.token_ids)
    assert harness.backend.flush_token_index(request, False) == 2


def test_empty_flush_makes_no_sdk_call(harness: Harness) -> None:
    seq = harness.new_sequence(3)
    assert harness.backend.flush_token_index(harness.request(seq, 3, 0), True) == 0
    assert control.calls("flush_token_index") == []


def test_failed_flush_is_a_counted_miss(harness: Harness) -> None:
    seq = harness.new_sequence(2)
    control.faults().fail_ops = frozenset({"flush_token_index"})
    assert harness.backend.flush_token_index(harness.request(seq), True) == 0
    assert harness.backend.stats()["backend_flush_sdk_errors"] == 1


def test_expired_flush_makes_no_sdk_call(harness: Harness) -> None:
    """The SDK call takes no timeout, so a request past its deadline must not start one."""
    seq = harness.new_sequence(2)
    request = harness.request(seq, timeout_s=1e-9)
    got = harness.backend.flush_token_index(request, True)
    assert got == 0 and got.failure is not None
    assert control.calls("flush_token_index") == []
    assert harness.backend.stats()["backend_flush_deadline_expired"] == 1


def test_an_integer_answer_is_used_when_the_sdk_gives_one(harness: Harness) -> None:
    seq = harness.new_sequence(4)
    harness.backend.plugin._client.flush_token_index = lambda *args: 2
    assert harness.backend.flush_token_index(harness.request(seq), False) == 2
