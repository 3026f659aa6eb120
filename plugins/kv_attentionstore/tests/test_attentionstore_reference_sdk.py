"""The stand-in SDK itself: the backend's tests are only as good as its faithfulness.

Its signatures are FastDeploy's calls (see reference_sdk/attentionstore_sdk/sdk.py for where
each was read); these tests pin them, so a backend calling any other way fails here first.
"""

from __future__ import annotations

import inspect
import time

import numpy as np
import pytest
from attentionstore_sdk import reference_control as control
from attentionstore_sdk.api.common.common_pb2 import MEDIA_HBM
from attentionstore_sdk.client.client import AttentionType
from attentionstore_sdk.sdk import AttentionStoreSDK, PerBlockBytesAttentionStoreSDK, Tokens
from attentionstore_sdk.utils.err import AttentionStoreSDKError

BS = 4  # tokens per block
K_BYTES = 32  # bytes per layer block of K
V_BYTES = 48  # of V: the current generation takes both sizes
LAYERS = 2
DEVICE_BLOCKS = 8
READ_KW = {"remote_addrs": None}
WRITE_KW = {"h2h_copy": False, "params": None}


def _sdk(namespace: str = "ns", v_bytes: int = V_BYTES) -> AttentionStoreSDK:
    return AttentionStoreSDK(
        namespace, "pod", "v0", 0, 1, LAYERS, BS, K_BYTES, v_bytes, 0, 0,
        attention_type=AttentionType.MHA, enable_as_kv_rw=True, gpu_count=0,
    )  # fmt: skip


def _tensors(seed: int | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)

    def make(nbytes: int) -> np.ndarray:
        if seed is None:
            return np.zeros((DEVICE_BLOCKS, nbytes), dtype=np.uint8)
        return rng.integers(0, 256, (DEVICE_BLOCKS, nbytes), dtype=np.uint8)

    return [make(K_BYTES) for _ in range(LAYERS)], [make(V_BYTES) for _ in range(LAYERS)]


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
    assert sdk.write([0, 1], tokens, 0, _ptrs(k_src), _ptrs(v_src), [5, 2, 7], 1.0, **WRITE_KW) == 3
    k_dst, v_dst = _tensors()
    assert sdk.read([0, 1], tokens, 1, _ptrs(k_dst), _ptrs(v_dst), [0, 3], 1.0, **READ_KW) == 2
    for layer in range(LAYERS):
        # stored block 1 came from device block 2, block 2 from device block 7
        assert (k_dst[layer][0] == k_src[layer][2]).all()
        assert (v_dst[layer][3] == v_src[layer][7]).all()
        untouched = [b for b in range(DEVICE_BLOCKS) if b not in (0, 3)]
        assert not k_dst[layer][untouched].any() and not v_dst[layer][untouched].any()


def test_the_call_shapes_are_fastdeploys() -> None:
    """Keyword arguments FastDeploy passes are required; extra positional ones are refused."""
    sdk = _sdk()
    tokens = Tokens(list(range(BS)), BS)
    k, v = _tensors()
    with pytest.raises(TypeError, match="remote_addrs"):
        sdk.read([0, 1], tokens, 0, _ptrs(k), _ptrs(v), [0], 1.0)
    with pytest.raises(TypeError, match="h2h_copy"):
        sdk.write([0, 1], tokens, 0, _ptrs(k), _ptrs(v), [0], 1.0, params=None)
    with pytest.raises(TypeError):  # flush_token_index takes no timeout
        sdk.flush_token_index([0, 1], tokens, 0, None, MEDIA_HBM, 1.0)
    with pytest.raises(TypeError, match="attention_type"):
        AttentionStoreSDK("ns", "pod", "v0", 0, 1, LAYERS, BS, K_BYTES, V_BYTES, 0, 0)
    older = PerBlockBytesAttentionStoreSDK("ns", "pod", "v0", 0, 1, LAYERS, BS, K_BYTES, 0, 0)
    with pytest.raises(TypeError, match="remote_addrs"):
        older.read([0, 1], tokens, 0, _ptrs(k), _ptrs(k), [0], 1.0, **READ_KW)
    with pytest.raises(TypeError, match="h2h_copy"):
        older.write([0, 1], tokens, 0, _ptrs(k), _ptrs(k), [0], 1.0, **WRITE_KW)
    assert len(inspect.signature(AttentionStoreSDK).parameters) == 14
    assert len(inspect.signature(PerBlockBytesAttentionStoreSDK).parameters) == 10


def test_match_counts_consecutive_blocks_from_the_start() -> None:
    sdk = _sdk()
    k, v = _tensors(seed=2)
    tokens = Tokens(list(range(5 * BS)), BS)
    assert sdk.write([0, 1], tokens, 0, _ptrs(k), _ptrs(v), [0, 1], 1.0, **WRITE_KW) == 2
    assert sdk.write([0, 1], tokens, 3, _ptrs(k), _ptrs(v), [3, 4], 1.0, **WRITE_KW) == 2
    assert sdk.match(tokens, 0, 1.0) == 2
    assert sdk.match(tokens, 3, 1.0) == 2
    assert sdk.match(tokens, 2, 1.0) == 0


def test_a_block_needs_every_layer_to_match() -> None:
    sdk = _sdk()
    k, v = _tensors(seed=3)
    tokens = Tokens(list(range(BS)), BS)
    assert sdk.write([0], tokens, 0, _ptrs(k)[:1], _ptrs(v)[:1], [0], 1.0, **WRITE_KW) == 1
    assert sdk.match(tokens, 0, 1.0) == 0
    assert sdk.write([1], tokens, 0, _ptrs(k)[1:], _ptrs(v)[1:], [0], 1.0, **WRITE_KW) == 1
    assert sdk.match(tokens, 0, 1.0) == 1


def test_write_keeps_bytes_already_stored() -> None:
    sdk = _sdk()
    tokens = Tokens(list(range(BS)), BS)
    k1, v1 = _tensors(seed=4)
    k2, v2 = _tensors(seed=5)
    sdk.write([0, 1], tokens, 0, _ptrs(k1), _ptrs(v1), [0], 1.0, **WRITE_KW)
    sdk.write([0, 1], tokens, 0, _ptrs(k2), _ptrs(v2), [0], 1.0, **WRITE_KW)
    k, v = _tensors()
    assert sdk.read([0, 1], tokens, 0, _ptrs(k), _ptrs(v), [0], 1.0, **READ_KW) == 1
    assert (k[0][0] == k1[0][0]).all()


def test_only_full_blocks_and_given_ids_are_processed() -> None:
    sdk = _sdk()
    k, v = _tensors(seed=6)
    short = Tokens(list(range(2 * BS + 1)), BS)
    assert sdk.write([0, 1], short, 0, _ptrs(k), _ptrs(v), [0, 1, 2, 3], 1.0, **WRITE_KW) == 2
    longer = Tokens(list(range(6 * BS)), BS)
    assert sdk.write([0, 1], longer, 2, _ptrs(k), _ptrs(v), [2], 1.0, **WRITE_KW) == 1
    assert sdk.match(longer, 0, 1.0) == 3


def test_stores_are_shared_by_namespace_and_geometry_across_instances() -> None:
    k, v = _tensors(seed=7)
    tokens = Tokens(list(range(BS)), BS)
    _sdk("a").write([0, 1], tokens, 0, _ptrs(k), _ptrs(v), [0], 1.0, **WRITE_KW)
    assert _sdk("a").match(tokens, 0, 1.0) == 1
    assert _sdk("b").match(tokens, 0, 1.0) == 0
    assert _sdk("a", v_bytes=2 * V_BYTES).match(tokens, 0, 1.0) == 0


def test_flush_records_residency_without_touching_data() -> None:
    sdk = _sdk()
    tokens = Tokens(list(range(3 * BS)), BS)
    assert sdk.flush_token_index([0, 1], tokens, 1, MEDIA_HBM, None) is None
    (call,) = control.calls("flush_token_index")
    assert (call.start_block_idx, call.media, call.reside_in_gpu) == (1, (MEDIA_HBM, None), False)
    assert call.timeout is None
    assert sorted(sdk.store.resident.values()) == [False, False]
    sdk.flush_token_index([0, 1], tokens, 2, None, MEDIA_HBM)
    assert sorted(sdk.store.resident.values()) == [False, True]
    assert sdk.store.blocks == {}


@pytest.mark.parametrize(
    "media", [(True, None), (None, None), (MEDIA_HBM, MEDIA_HBM), (None, 99)], ids=str
)
def test_flush_refuses_anything_but_fastdeploys_two_media_pairs(media: tuple) -> None:
    with pytest.raises(AttentionStoreSDKError, match="media"):
        _sdk().flush_token_index([0, 1], Tokens(list(range(BS)), BS), 0, *media)


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
        sdk.read([0, 1], tokens, 0, [0, 0], [0, 0], [0], 1.0, **READ_KW)
    control.faults().delay_s = 5.0
    t0 = time.monotonic()
    with pytest.raises(AttentionStoreSDKError, match="timed out"):
        sdk.match(tokens, 0, 0.1)
    assert time.monotonic() - t0 < 2.5  # half the 5 s delay: the timeout ended it


def test_bad_arguments_are_sdk_errors() -> None:
    sdk = _sdk()
    tokens = Tokens(list(range(BS)), BS)
    with pytest.raises(AttentionStoreSDKError, match="out of range"):
        sdk.read([0, 5], tokens, 0, [0, 0], [0, 0], [0], 1.0, **READ_KW)
    with pytest.raises(AttentionStoreSDKError, match="tokens per block"):
        sdk.match(Tokens(list(range(8)), 8), 0, 1.0)
    with pytest.raises(AttentionStoreSDKError, match="AttentionType"):
        AttentionStoreSDK(
            "ns", "pod", "v0", 0, 1, LAYERS, BS, K_BYTES, V_BYTES, 0, 0,
            attention_type="MHA", enable_as_kv_rw=True, gpu_count=0,
        )  # fmt: skip


def test_calls_past_their_timeout_stop_between_blocks() -> None:
    sdk = _sdk()
    tokens = Tokens(list(range(3 * BS)), BS)
    k, v = _tensors(seed=8)
    assert sdk.write([0, 1], tokens, 0, _ptrs(k), _ptrs(v), [0, 1, 2], 0.0, **WRITE_KW) == 0
    assert sdk.write([0, 1], tokens, 0, _ptrs(k), _ptrs(v), [0, 1, 2], 5.0, **WRITE_KW) == 3
    assert sdk.read([0, 1], tokens, 0, _ptrs(k), _ptrs(v), [0, 1, 2], 0.0, **READ_KW) == 0
