"""SDK arguments: both constructor shapes, FastDeploy's variables and defaults, the context.

FastDeploy's AttentionStore backend (attention_store.py at PaddlePaddle/FastDeploy@1af00818)
builds the SDK from its config, AS_NAMESPACE / AS_POD_NAME / AS_MODEL_VERSION and
ENABLE_EP_DP_IN_FD (lines 71-77), with one of two constructors (lines 80-95, 97-108). The
backend must end up with the same arguments for the same settings.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from attentionstore_sdk import reference_control as control
from attentionstore_sdk.client.client import AttentionType
from kv_attentionstore import AttentionStoreConfig, resolve_settings

import kvcore
from kvcore.testing import Harness, small_layout


def _sdk_args() -> dict:
    return control.instances()[-1].args


def test_current_sdk_gets_fastdeploys_k_v_constructor(open_as: Callable[..., Harness]) -> None:
    lay = small_layout()
    open_as(rank=1, world_size=4, device_id=3, namespace="ernie-0.3b")
    kv_bytes = lay.num_heads * lay.block_size * lay.head_dim * 2
    assert _sdk_args() == {
        "namespace": "ernie-0.3b",
        "pod_name": "default_pod_mixed_0",  # ENABLE_EP_DP_IN_FD defaults to on
        "model_version": "v0",
        "shard_id": 1,
        "shard_num": 4,
        "layer_num": lay.num_layers + lay.num_extra_layers,
        "block_token_size": lay.block_size,
        "k_bytes_per_shard_layer_per_block": kv_bytes,
        "v_bytes_per_shard_layer_per_block": kv_bytes,
        "device_id": 3,
        "dp_id": 0,
        "attention_type": AttentionType.MHA,
        "enable_as_kv_rw": True,
        "gpu_count": 0,
    }


def test_older_sdk_gets_the_one_size_constructor(
    per_block_sdk: None, open_as: Callable[..., Harness]
) -> None:
    lay = small_layout()
    h = open_as(namespace="m")
    assert h.backend.plugin.settings.constructor == "per_block_bytes"
    assert _sdk_args() == {
        "namespace": "m",
        "pod_name": "default_pod_mixed_0",
        "model_version": "v0",
        "shard_id": 0,
        "shard_num": 1,
        "layer_num": lay.total_layers,
        "block_token_size": lay.block_size,
        "bytes_per_shard_layer_per_block": lay.kv_layer_block_bytes,
        "device_id": 0,
        "dp_id": 0,
    }


def test_the_constructor_can_be_named(open_as: Callable[..., Harness]) -> None:
    h = open_as({"sdk_constructor": "kv_bytes", "attention_type": "MLA"})
    assert _sdk_args()["attention_type"] is AttentionType.MLA
    assert h.backend.plugin.settings.read_kwargs == {"remote_addrs": None}
    with pytest.raises(kvcore.ConfigError, match="attention_type"):
        open_as({"attention_type": "GQA"})


def test_k_v_constructor_on_an_sdk_without_attention_type_is_named(
    per_block_sdk: None, fast_config: dict
) -> None:
    with pytest.raises(kvcore.ConfigError, match="AttentionType"):
        kvcore.open_backend(
            "attentionstore",
            {**fast_config, "sdk_constructor": "kv_bytes"},
            context={"layout": small_layout()},
        )


def test_config_overrides_the_context(open_as: Callable[..., Harness]) -> None:
    open_as(
        {"namespace": "ns", "shard_id": 0, "shard_num": 1, "dp_id": 2, "model_version": "v7"},
        rank=1,
        world_size=2,
    )
    args = _sdk_args()
    assert (args["namespace"], args["shard_id"], args["shard_num"]) == ("ns", 0, 1)
    assert (args["dp_id"], args["model_version"], args["pod_name"]) == (
        2,
        "v7",
        "default_pod_mixed_2",
    )


def test_fastdeploys_variables_override_the_config(
    open_as: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AS_NAMESPACE", "from-env")
    monkeypatch.setenv("AS_POD_NAME", "node-7")
    monkeypatch.setenv("AS_MODEL_VERSION", "v9")
    open_as(
        {"pod_name": "from-config", "namespace": "cfg", "splitwise_role": "prefill", "dp_id": 1}
    )
    args = _sdk_args()
    assert (args["namespace"], args["pod_name"], args["model_version"]) == (
        "from-env",
        "node-7_prefill_1",
        "v9",
    )


@pytest.mark.parametrize(("value", "pod"), [("0", "pod"), ("1", "pod_decode_3")])
def test_enable_ep_dp_in_fd_decides_the_pod_suffix(
    open_as: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch, value: str, pod: str
) -> None:
    monkeypatch.setenv("ENABLE_EP_DP_IN_FD", value)
    open_as({"pod_name": "pod", "splitwise_role": "decode", "dp_id": 3})
    assert _sdk_args()["pod_name"] == pod


def test_fastdeploys_write_variables_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = AttentionStoreConfig.load({})
    assert (cfg.write_slice_block_num, cfg.write_slice_timeout, cfg.write_total_timeout) == (
        100,
        10.0,
        None,
    )
    assert (cfg.readiness_timeout_s, cfg.readiness_poll_s, cfg.only_flush) == (300.0, 5.0, False)
    monkeypatch.setenv("AS_WRITE_SLICE_BLOCK_NUM", "7")
    monkeypatch.setenv("AS_WRITE_SLICE_TIMEOUT", "2.5")
    monkeypatch.setenv("AS_WRITE_TOTAL_TIMEOUT", "30")
    monkeypatch.setenv("FD_AS_ONLY_FLUSH", "1")
    cfg = AttentionStoreConfig.load({})
    assert (cfg.write_slice_block_num, cfg.write_slice_timeout, cfg.write_total_timeout) == (
        7,
        2.5,
        30.0,
    )
    assert cfg.only_flush is True


@pytest.mark.parametrize(
    ("var", "value", "field"),
    [
        ("AS_WRITE_SLICE_BLOCK_NUM", "0", "write_slice_block_num"),
        ("AS_WRITE_SLICE_TIMEOUT", "soon", "write_slice_timeout"),
        ("FD_AS_ONLY_FLUSH", "maybe", "only_flush"),
        ("ENABLE_EP_DP_IN_FD", "2", "enable_ep_dp_in_fd"),
    ],
)
def test_bad_variable_is_named(
    monkeypatch: pytest.MonkeyPatch, fast_config: dict, var: str, value: str, field: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(kvcore.ConfigError, match=field):
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
    assert (s.layer_num, s.block_token_size, s.k_bytes_per_shard_layer_per_block) == (5, 16, 64)
    assert s.namespace == "m"


def test_k_and_v_sizes_may_differ_only_with_the_k_v_constructor() -> None:
    ctx = kvcore.BackendContext(layout=small_layout())
    cfg = AttentionStoreConfig(v_bytes_per_shard_layer_per_block=7, sdk_constructor="kv_bytes")
    assert resolve_settings(cfg, ctx).v_bytes_per_shard_layer_per_block == 7
    cfg = AttentionStoreConfig(
        v_bytes_per_shard_layer_per_block=7, sdk_constructor="per_block_bytes"
    )
    with pytest.raises(kvcore.ConfigError, match="v_bytes_per_shard_layer_per_block: 7"):
        resolve_settings(cfg, ctx)


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


def test_fp8_layout_is_accepted_when_only_the_index_is_kept(
    open_as: Callable[..., Harness],
) -> None:
    """FastDeploy allows block_wise_fp8 with FD_AS_ONLY_FLUSH (no data moves); nothing reads."""
    h = open_as({"only_flush": True}, layout=small_layout("block_wise_fp8"))
    seq = h.new_sequence(2)
    assert h.write(seq) == 0
    assert h.query(seq) == 0
    assert control.calls("flush_token_index")[-1].reside_in_gpu is True
    assert [c.op for c in control.calls()] == ["match", "flush_token_index"]


def test_capabilities_declare_no_scales() -> None:
    from kv_attentionstore import AttentionStoreBackend

    caps = AttentionStoreBackend.capabilities
    assert (caps.addressing, caps.io, caps.token_index, caps.scales) == (
        "token",
        "device",
        True,
        False,
    )
