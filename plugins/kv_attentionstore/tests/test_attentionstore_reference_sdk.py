"""The stand-in SDK itself: the backend's tests are only as good as its faithfulness."""

from __future__ import annotations

import time

import numpy as np
import pytest
from attentionstore_sdk import reference_control as control
from attentionstore_sdk.sdk import AttentionStoreSDK, Tokens
from attentionstore_sdk.utils.err import AttentionStoreSDKError

BS = 4  # tokens per block
BPB = 32  # bytes per layer block
LAYERS = 2
DEVICE_BLOCKS = 8


def _sdk(namespace: str = "ns") -> AttentionStoreSDK:
    return AttentionStoreSDK(namespace, "pod", "v0", 0, 1, LAYERS, BS, BPB, 0, 0)


def _tensors(seed: int | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)

    def make() -> np.ndarray:
        if seed is None:
            return np.zeros((DEVICE_BLOCKS, BPB), dtype=np.uint8)
        return rng.integers(0, 256, (DEVICE_BLOCKS, BPB), dtype=np.uint8)

    return [make() for _ in range(LAYERS)], [make() for _ in range(LAYERS)]


def _ptrs(arrays: list[np.ndarray]) -> list[int]:
    return [a.ctypes.data for a in arrays]


def test_a_block_is_named_by_its_whole_prefix() -> None:
    a = Tokens([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = Tokens([9, 9, 9, 9, 5, 6, 7, 8], BS)  # same second block, different first
    assert a.num_blocks == b.num_blocks == 2
    assert a.block_hashes[1] != b.block_hashes[1]
    assert Tokens([1, 2, 3, 4, 5], BS).block_hashes == a.block_hashes[:1]


def test_write_then_read_copies_each_layer_block_at_its_offset() -> None:
    sdk = _sdk()
    tokens = Tokens(list(range(3 * BS)), BS)
    k_src, v_src = _tensors(seed=1)
    assert sdk.write([0, 1], tokens, 0, _ptrs(k_src), _ptrs(v_src), [5, 2, 7], 1.0) == 3
    k_dst, v_dst = _tensors()
    assert sdk.read([0, 1], tokens, 1, _ptrs(k_dst), _ptrs(v_dst), [0, 3], 1.0) == 2
    for layer in range(LAYERS):
        # stored block 1 came from device block 2, block 2 from device block 7
        assert (k_dst[layer][0] == k_src[layer][2]).all()
        assert (v_dst[layer][3] == v_src[layer][7]).all()
        untouched = [b for b in range(DEVICE_BLOCKS) if b not in (0, 3)]
        assert not k_dst[layer][untouched].any() and not v_dst[layer][untouched].any()


def test_match_counts_consecutive_blocks_from_the_start() -> None:
    sdk = _sdk()
    k, v = _tensors(seed=2)
    tokens = Tokens(list(range(5 * BS)), BS)
    assert sdk.write([0, 1], tokens, 0, _ptrs(k), _ptrs(v), [0, 1], 1.0) == 2
    assert sdk.write([0, 1], tokens, 3, _ptrs(k), _ptrs(v), [3, 4], 1.0) == 2
    assert sdk.match(tokens, 0, 1.0) == 2
    assert sdk.match(tokens, 3, 1.0) == 2
    assert sdk.match(tokens, 2, 1.0) == 0


def test_a_block_needs_every_layer_to_match() -> None:
    sdk = _sdk()
    k, v = _tensors(seed=3)
    tokens = Tokens(list(range(BS)), BS)
    assert sdk.write([0], tokens, 0, _ptrs(k)[:1], _ptrs(v)[:1], [0], 1.0) == 1
    assert sdk.match(tokens, 0, 1.0) == 0
    assert sdk.write([1], tokens, 0, _ptrs(k)[1:], _ptrs(v)[1:], [0], 1.0) == 1
    assert sdk.match(tokens, 0, 1.0) == 1


def test_write_keeps_bytes_already_stored() -> None:
    sdk = _sdk()
    tokens = Tokens(list(range(BS)), BS)
    k1, v1 = _tensors(seed=4)
    k2, v2 = _tensors(seed=5)
    sdk.write([0, 1], tokens, 0, _ptrs(k1), _ptrs(v1), [0], 1.0)
    sdk.write([0, 1], tokens, 0, _ptrs(k2), _ptrs(v2), [0], 1.0)
    k, v = _tensors()
    assert sdk.read([0, 1], tokens, 0, _ptrs(k), _ptrs(v), [0], 1.0) == 1
    assert (k[0][0] == k1[0][0]).all()


def test_only_full_blocks_and_given_ids_are_processed() -> None:
    sdk = _sdk()
    k, v = _tensors(seed=6)
    short = Tokens(list(range(2 * BS + 1)), BS)
    assert sdk.write([0, 1], short, 0, _ptrs(k), _ptrs(v), [0, 1, 2, 3], 1.0) == 2
    longer = Tokens(list(range(6 * BS)), BS)
    assert sdk.write([0, 1], longer, 2, _ptrs(k), _ptrs(v), [2], 1.0) == 1
    assert sdk.match(longer, 0, 1.0) == 3


def test_stores_are_shared_by_namespace_and_geometry_across_instances() -> None:
    k, v = _tensors(seed=7)
    tokens = Tokens(list(range(BS)), BS)
    _sdk("a").write([0, 1], tokens, 0, _ptrs(k), _ptrs(v), [0], 1.0)
    assert _sdk("a").match(tokens, 0, 1.0) == 1
    assert _sdk("b").match(tokens, 0, 1.0) == 0
    other_geometry = AttentionStoreSDK("a", "pod", "v0", 0, 1, LAYERS, BS, 2 * BPB, 0, 0)
    assert other_geometry.match(tokens, 0, 1.0) == 0


def test_flush_records_residency_without_touching_data() -> None:
    sdk = _sdk()
    tokens = Tokens(list(range(3 * BS)), BS)
    assert sdk.flush_token_index([0, 1], tokens, 1, False, 1.0) == 2
    (call,) = control.calls("flush_token_index")
    assert (call.start_block_idx, call.reside_in_gpu, call.result) == (1, False, 2)
    assert sorted(sdk.store.resident.values()) == [False, False]
    assert sdk.store.blocks == {}


def test_faults_not_ready_fail_and_slow() -> None:
    sdk = _sdk()
    tokens = Tokens(list(range(BS)), BS)
    control.faults().not_ready_calls = 2
    for _ in range(2):
        with pytest.raises(AttentionStoreSDKError, match="cuda memory not ready"):
            sdk.match(tokens, 0, 1.0)
    assert sdk.match(tokens, 0, 1.0) == 0
    control.faults().fail_ops = frozenset({"read"})
    with pytest.raises(AttentionStoreSDKError, match="injected"):
        sdk.read([0, 1], tokens, 0, [0, 0], [0, 0], [0], 1.0)
    control.faults().delay_s = 5.0
    t0 = time.monotonic()
    with pytest.raises(AttentionStoreSDKError, match="timed out"):
        sdk.match(tokens, 0, 0.1)
    assert time.monotonic() - t0 < 1.0


def test_bad_arguments_are_sdk_errors() -> None:
    sdk = _sdk()
    tokens = Tokens(list(range(BS)), BS)
    with pytest.raises(AttentionStoreSDKError, match="out of range"):
        sdk.read([0, 5], tokens, 0, [0, 0], [0, 0], [0], 1.0)
    with pytest.raises(AttentionStoreSDKError, match="tokens per block"):
        sdk.match(Tokens(list(range(8)), 8), 0, 1.0)
