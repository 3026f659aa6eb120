"""Settings of the AttentionStore backend and how they resolve against the engine's context.

Most SDK constructor arguments describe the engine (layers, block size, shard), so they default
from :class:`kvcore.BackendContext`; a value set in the config or an ``AS_*`` variable wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

import kvcore
from kvcore.errors import ConfigError


class AttentionStoreConfig(kvcore.BackendConfig):
    """``AS_<FIELD>`` overrides each field, e.g. ``AS_POD_NAME=node-7``, ``AS_LAYER_NUM=62``.

    Fields left at ``None`` are derived from the backend context when the backend opens.
    """

    env_prefix = "AS_"

    namespace: str | None = Field(default=None, description="None: the context's namespace")
    pod_name: str = Field(default="default_pod", min_length=1)
    model_version: str = Field(default="v0", min_length=1)
    splitwise_role: Literal["mixed", "prefill", "decode"] = Field(
        default="mixed", description="PD disaggregation role; a non-mixed role joins the pod name"
    )
    shard_id: int | None = Field(default=None, ge=0, description="None: the context's rank")
    shard_num: int | None = Field(default=None, ge=1, description="None: the world size (TP)")
    layer_num: int | None = Field(
        default=None, gt=0, description="None: the layout's layers, extra (MTP) layers included"
    )
    block_token_size: int | None = Field(default=None, gt=0, description="None: block_size")
    k_bytes_per_shard_layer_per_block: int | None = Field(default=None, gt=0)
    v_bytes_per_shard_layer_per_block: int | None = Field(default=None, gt=0)
    device_id: int | None = Field(default=None, ge=0, description="None: the context's device")
    dp_id: int = Field(default=0, ge=0, description="data-parallel replica id")
    readiness_timeout_s: float = Field(
        default=300.0, gt=0, description="how long opening waits for the SDK to become ready"
    )
    readiness_poll_s: float = Field(default=5.0, gt=0, description="pause between readiness probes")
    write_slice_blocks: int = Field(default=64, gt=0, description="blocks per SDK write call")
    write_slice_timeout_s: float = Field(
        default=30.0, gt=0, description="cap on one write slice (the request deadline also caps it)"
    )

    @model_validator(mode="after")
    def _shard_in_range(self) -> AttentionStoreConfig:
        both = self.shard_id is not None and self.shard_num is not None
        if both and self.shard_id >= self.shard_num:
            raise ValueError(f"shard_id {self.shard_id} must be < shard_num {self.shard_num}")
        return self


@dataclass(frozen=True, slots=True)
class SdkSettings:
    """The exact arguments the SDK is constructed with, after defaults were resolved."""

    namespace: str
    pod_name: str
    model_version: str
    shard_id: int
    shard_num: int
    layer_num: int
    block_token_size: int
    bytes_per_shard_layer_per_block: int
    device_id: int
    dp_id: int

    def constructor_args(self) -> tuple[object, ...]:
        """Positional arguments in the order ``AttentionStoreSDK(...)`` takes them."""
        return (
            self.namespace,
            self.pod_name,
            self.model_version,
            self.shard_id,
            self.shard_num,
            self.layer_num,
            self.block_token_size,
            self.bytes_per_shard_layer_per_block,
            self.device_id,
            self.dp_id,
        )


def resolve_settings(config: AttentionStoreConfig, context: kvcore.BackendContext) -> SdkSettings:
    """Fill unset fields from ``context``; raise :class:`ConfigError` naming what is missing."""
    layout = context.layout
    if layout is not None and layout.dtype.has_scales:
        raise ConfigError(
            f"invalid config for backend 'attentionstore':\n  layout.dtype: {layout.dtype.value} "
            "needs fp8 scale tensors, but the AttentionStore SDK takes only K and V pointers; "
            "use a bfloat16, float16 or uint8 cache"
        )

    def pick(field: str, from_layout: int | None) -> int:
        value = getattr(config, field)
        if value is not None:
            return value
        if from_layout is None:
            raise ConfigError(
                f"invalid config for backend 'attentionstore':\n  {field}: not set and the "
                f"backend context has no layout to derive it from; set it or AS_{field.upper()}"
            )
        return from_layout

    kv_bytes = layout.kv_layer_block_bytes if layout is not None else None
    k_bytes = pick("k_bytes_per_shard_layer_per_block", kv_bytes)
    v_bytes = pick("v_bytes_per_shard_layer_per_block", kv_bytes)
    if k_bytes != v_bytes:
        raise ConfigError(
            "invalid config for backend 'attentionstore':\n  v_bytes_per_shard_layer_per_block: "
            f"{v_bytes} differs from k_bytes_per_shard_layer_per_block {k_bytes}; the SDK takes "
            "one bytes_per_shard_layer_per_block for both"
        )
    shard_id = context.rank if config.shard_id is None else config.shard_id
    shard_num = context.world_size if config.shard_num is None else config.shard_num
    if shard_id >= shard_num:
        raise ConfigError(
            f"invalid config for backend 'attentionstore':\n  shard_id: {shard_id} must be < "
            f"shard_num {shard_num}"
        )
    pod = config.pod_name
    if config.splitwise_role != "mixed":
        # prefill and decode instances of one deployment must not share an index identity
        pod = f"{pod}-{config.splitwise_role}"
    return SdkSettings(
        namespace=context.namespace if config.namespace is None else config.namespace,
        pod_name=pod,
        model_version=config.model_version,
        shard_id=shard_id,
        shard_num=shard_num,
        layer_num=pick("layer_num", layout.total_layers if layout is not None else None),
        block_token_size=pick("block_token_size", layout.block_size if layout else None),
        bytes_per_shard_layer_per_block=k_bytes,
        device_id=context.device_id if config.device_id is None else config.device_id,
        dp_id=config.dp_id,
    )
