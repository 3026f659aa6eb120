"""SDK arguments default from the backend context; config and AS_* variables override them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from attentionstore_sdk import reference_control as control
from kv_attentionstore import AttentionStoreConfig, resolve_settings

import kvcore
from kvcore.testing import Harness, small_layout


def _sdk_args() -> dict:
    return control.instances()[-1].args


def test_defaults_come_from_the_context(open_as: Callable[..., Harness]) -> None:
    lay = small_layout()
    open_as(rank=1, world_size=4, device_id=3, namespace="ernie-0.3b")
    assert _sdk_args() == {
        "namespace": "ernie-0.3b",
        "pod_name": "default_pod",
        "model_version": "v0",
        "shard_id": 1,
        "shard_num": 4,
        "layer_num": lay.num_layers + lay.num_extra_layers,
        "block_token_size": lay.block_size,
        "bytes_per_shard_layer_per_block": lay.num_heads * lay.block_size * lay.head_dim * 2,
        "device_id": 3,
        "dp_id": 0,
    }


def test_config_overrides_the_context(open_as: Callable[..., Harness]) -> None:
    open_as(
        {"namespace": "ns", "shard_id": 0, "shard_num": 1, "dp_id": 2, "model_version": "v7"},
        rank=1,
        world_size=2,
    )
    args = _sdk_args()
    assert (args["namespace"], args["shard_id"], args["shard_num"]) == ("ns", 0, 1)
    assert (args["dp_id"], args["model_version"]) == (2, "v7")


def test_as_variables_override_the_config(
    open_as: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AS_POD_NAME", "node-7")
    monkeypatch.setenv("AS_SPLITWISE_ROLE", "prefill")
    monkeypatch.setenv("AS_DP_ID", "5")
    monkeypatch.setenv("AS_WRITE_SLICE_BLOCKS", "3")
    h = open_as({"pod_name": "from-config", "dp_id": 1})
    assert _sdk_args()["pod_name"] == "node-7-prefill"
    assert _sdk_args()["dp_id"] == 5
    assert h.backend.config.write_slice_blocks == 3


def test_mixed_role_keeps_the_pod_name(open_as: Callable[..., Harness]) -> None:
    open_as({"pod_name": "node-1"})
    assert _sdk_args()["pod_name"] == "node-1"


def test_bad_as_variable_is_named(monkeypatch: pytest.MonkeyPatch, fast_config: dict) -> None:
    monkeypatch.setenv("AS_WRITE_SLICE_BLOCKS", "0")
    with pytest.raises(kvcore.ConfigError, match="write_slice_blocks"):
        kvcore.open_backend("attentionstore", fast_config, context={"layout": small_layout()})


def test_without_a_layout_the_missing_field_is_named() -> None:
    cfg = AttentionStoreConfig(k_bytes_per_shard_layer_per_block=64)
    with pytest.raises(kvcore.ConfigError, match="v_bytes_per_shard_layer_per_block"):
        resolve_settings(cfg, kvcore.BackendContext())
    cfg = AttentionStoreConfig(
        k_bytes_per_shard_layer_per_block=64, v_bytes_per_shard_layer_per_block=64
    )
    with pytest.raises(kvcore.ConfigError, match="AS_LAYER_NUM"):
        resolve_settings(cfg, kvcore.BackendContext())


def test_fully_configured_without_a_layout() -> None:
    cfg = AttentionStoreConfig(
        k_bytes_per_shard_layer_per_block=64,
        v_bytes_per_shard_layer_per_block=64,
        layer_num=5,
        block_token_size=16,
    )
    s = resolve_settings(cfg, kvcore.BackendContext(namespace="m"))
    assert (s.layer_num, s.block_token_size, s.bytes_per_shard_layer_per_block) == (5, 16, 64)
    assert s.constructor_args()[0] == "m"


def test_k_and_v_sizes_must_agree() -> None:
    cfg = AttentionStoreConfig(v_bytes_per_shard_layer_per_block=7)
    with pytest.raises(kvcore.ConfigError, match="v_bytes_per_shard_layer_per_block: 7"):
        resolve_settings(cfg, kvcore.BackendContext(layout=small_layout()))


def test_shard_id_must_be_below_shard_num() -> None:
    with pytest.raises(ValueError, match="shard_id 2 must be < shard_num 2"):
        AttentionStoreConfig(shard_id=2, shard_num=2)
    cfg = AttentionStoreConfig(shard_id=3)  # shard_num from the context's world size
    with pytest.raises(kvcore.ConfigError, match="shard_id"):
        resolve_settings(cfg, kvcore.BackendContext(layout=small_layout(), world_size=2))


def test_fp8_layout_is_refused_because_the_sdk_has_no_scale_pointers(
    open_as: Callable[..., Harness],
) -> None:
    with pytest.raises(kvcore.ConfigError, match="scale"):
        open_as(layout=small_layout("block_wise_fp8"))
    assert control.instances() == []


def test_capabilities_declare_no_scales() -> None:
    from kv_attentionstore import AttentionStoreBackend

    caps = AttentionStoreBackend.capabilities
    assert (caps.addressing, caps.io, caps.token_index, caps.scales) == (
        "token",
        "device",
        True,
        False,
    )
