"""Settings of the AttentionStore backend and how they resolve against the engine's context.

Most SDK constructor arguments describe the engine (layers, block size, shard), so they default
from :class:`kvcore.BackendContext`; a value set in the config or an environment variable wins.
The variables are FastDeploy's own (``AS_NAMESPACE``, ``AS_POD_NAME``, ``AS_MODEL_VERSION``,
``AS_WRITE_SLICE_BLOCK_NUM``, ``AS_WRITE_SLICE_TIMEOUT``, ``AS_WRITE_TOTAL_TIMEOUT``,
``ENABLE_EP_DP_IN_FD``, ``FD_AS_ONLY_FLUSH``) with FastDeploy's defaults, so a kvcore engine
and a FastDeploy pod configured alike open the SDK alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, model_validator

import kvcore
from kv_attentionstore.sdk_loader import ConstructorShape, SdkModule, detect_constructor
from kvcore.errors import ConfigError
from kvcore.schemas import timeout_field

#: FastDeploy's variables whose names do not follow ``AS_<FIELD>``, and the field each sets.
FASTDEPLOY_ALIASES = {"ENABLE_EP_DP_IN_FD": "enable_ep_dp_in_fd", "FD_AS_ONLY_FLUSH": "only_flush"}


class AttentionStoreConfig(kvcore.BackendConfig):
    """``AS_<FIELD>`` overrides each field, e.g. ``AS_POD_NAME=node-7``, ``AS_LAYER_NUM=62``.

    Fields left at ``None`` are derived from the backend context when the backend opens.
    """

    env_prefix = "AS_"

    namespace: str | None = Field(default=None, description="None: the context's namespace")
    pod_name: str = Field(default="default_pod", min_length=1)
    model_version: str = Field(default="v0", min_length=1)
    splitwise_role: Literal["mixed", "prefill", "decode"] = Field(
        default="mixed", description="PD disaggregation role; part of the pod name"
    )
    dp_id: int = Field(
        default=0, ge=0, description="data-parallel replica id; part of the pod name"
    )
    enable_ep_dp_in_fd: bool = Field(
        default=True,
        description="as FastDeploy's ENABLE_EP_DP_IN_FD: the SDK's pod name becomes "
        "'<pod_name>_<splitwise_role>_<dp_id>'",
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
    sdk_constructor: Literal["auto", "per_block_bytes", "kv_bytes"] = Field(
        default="auto",
        description="per_block_bytes: AttentionStoreSDK(..., bytes_per_shard_layer_per_block, "
        "device_id, dp_id); kv_bytes: (..., k_bytes, v_bytes, device_id, dp_id, "
        "attention_type=, enable_as_kv_rw=True, gpu_count=0); auto: what the SDK accepts",
    )
    attention_type: str = Field(
        default="MHA", min_length=1, description="AttentionType member (kv_bytes constructor)"
    )
    readiness_timeout_s: float = timeout_field(
        300.0, "how long opening waits for the SDK to become ready"
    )
    readiness_poll_s: float = timeout_field(5.0, "pause between readiness probes")
    write_slice_block_num: int = Field(default=100, gt=0, description="blocks per SDK write call")
    write_slice_timeout: float = timeout_field(
        10.0, "timeout of one write slice (capped by the deadline)"
    )
    write_total_timeout: float | None = timeout_field(
        None, "cap on a whole write; None: the request's deadline only"
    )
    only_flush: bool = Field(
        default=False,
        description="as FastDeploy's FD_AS_ONLY_FLUSH: AttentionStore is an index only; a "
        "write stores no data and records the blocks as resident on this device",
    )

    @classmethod
    def env_overrides(cls, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        environ = os.environ if environ is None else environ
        found = super().env_overrides(environ)
        for var, name in FASTDEPLOY_ALIASES.items():
            if name not in found and environ.get(var) is not None:
                found[name] = environ[var]
        return found

    @model_validator(mode="after")
    def _shard_in_range(self) -> AttentionStoreConfig:
        shard_id, shard_num = self.shard_id, self.shard_num
        if shard_id is not None and shard_num is not None and shard_id >= shard_num:
            raise ValueError(f"shard_id {self.shard_id} must be < shard_num {self.shard_num}")
        return self


@dataclass(frozen=True, slots=True)
class SdkSettings:
    """What the SDK is constructed with, after defaults were resolved."""

    namespace: str
    pod_name: str
    model_version: str
    shard_id: int
    shard_num: int
    layer_num: int
    block_token_size: int
    k_bytes_per_shard_layer_per_block: int
    v_bytes_per_shard_layer_per_block: int
    device_id: int
    dp_id: int
    constructor: ConstructorShape
    attention_type: str = "MHA"
    # keyword arguments FastDeploy adds to read and write with the K/V constructor's SDK
    read_kwargs: dict[str, Any] = field(default_factory=dict)
    write_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def layer_ids(self) -> list[int]:
        return list(range(self.layer_num))

    def constructor_call(self, sdk: SdkModule) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Positional and keyword arguments of ``AttentionStoreSDK(...)``, as FastDeploy passes
        them (attention_store.py at 1af00818, lines 80-95 and 97-108)."""
        head = (
            self.namespace,
            self.pod_name,
            self.model_version,
            self.shard_id,
            self.shard_num,
            self.layer_num,
            self.block_token_size,
        )
        tail = (self.device_id, self.dp_id)
        if self.constructor == "per_block_bytes":
            return (*head, self.k_bytes_per_shard_layer_per_block, *tail), {}
        if sdk.attention_type is None:
            raise ConfigError(
                "invalid config for backend 'attentionstore':\n  sdk_constructor: kv_bytes needs "
                "attentionstore_sdk.client.client.AttentionType, which this SDK lacks"
            )
        try:
            attention_type = getattr(sdk.attention_type, self.attention_type)
        except AttributeError:
            raise ConfigError(
                "invalid config for backend 'attentionstore':\n  attention_type: "
                f"{self.attention_type!r} is not a member of the SDK's AttentionType"
            ) from None
        sizes = (self.k_bytes_per_shard_layer_per_block, self.v_bytes_per_shard_layer_per_block)
        kwargs = {"attention_type": attention_type, "enable_as_kv_rw": True, "gpu_count": 0}
        return (*head, *sizes, *tail), kwargs


def resolve_settings(
    config: AttentionStoreConfig, context: kvcore.BackendContext, sdk: SdkModule | None = None
) -> SdkSettings:
    """Fill unset fields from ``context``; raise :class:`ConfigError` naming what is missing.

    ``sdk`` decides ``sdk_constructor="auto"`` (without it, auto means ``per_block_bytes``).
    """
    layout = context.layout
    if layout is not None and layout.dtype.has_scales and not config.only_flush:
        raise ConfigError(
            f"invalid config for backend 'attentionstore':\n  layout.dtype: {layout.dtype.value} "
            "needs fp8 scale tensors, but the AttentionStore SDK takes only K and V pointers; "
            "use a bfloat16, float16 or uint8 cache (or only_flush / FD_AS_ONLY_FLUSH=1, where "
            "no data moves)"
        )

    def pick(name: str, from_layout: int | None) -> int:
        value = getattr(config, name)
        if value is not None:
            return value
        if from_layout is None:
            raise ConfigError(
                f"invalid config for backend 'attentionstore':\n  {name}: not set and the "
                f"backend context has no layout to derive it from; set it or AS_{name.upper()}"
            )
        return from_layout

    kv_bytes = layout.kv_layer_block_bytes if layout is not None else None
    k_bytes = pick("k_bytes_per_shard_layer_per_block", kv_bytes)
    v_bytes = pick("v_bytes_per_shard_layer_per_block", kv_bytes)
    shape: ConstructorShape
    if config.sdk_constructor != "auto":
        shape = config.sdk_constructor
    else:
        shape = detect_constructor(sdk) if sdk is not None else "per_block_bytes"
    if shape == "per_block_bytes" and k_bytes != v_bytes:
        raise ConfigError(
            "invalid config for backend 'attentionstore':\n  v_bytes_per_shard_layer_per_block: "
            f"{v_bytes} differs from k_bytes_per_shard_layer_per_block {k_bytes}; this SDK's "
            "constructor takes one bytes_per_shard_layer_per_block for both"
        )
    shard_id = context.rank if config.shard_id is None else config.shard_id
    shard_num = context.world_size if config.shard_num is None else config.shard_num
    if shard_id >= shard_num:
        raise ConfigError(
            f"invalid config for backend 'attentionstore':\n  shard_id: {shard_id} must be < "
            f"shard_num {shard_num}"
        )
    pod = config.pod_name
    if config.enable_ep_dp_in_fd:
        # FastDeploy's pod identity (attention_store.py at 1af00818, lines 72-76): prefill,
        # decode and each data-parallel replica register as different pods
        pod = f"{pod}_{config.splitwise_role}_{config.dp_id}"
    kv_shape = shape == "kv_bytes"
    return SdkSettings(
        namespace=context.namespace if config.namespace is None else config.namespace,
        pod_name=pod,
        model_version=config.model_version,
        shard_id=shard_id,
        shard_num=shard_num,
        layer_num=pick("layer_num", layout.total_layers if layout is not None else None),
        block_token_size=pick("block_token_size", layout.block_size if layout else None),
        k_bytes_per_shard_layer_per_block=k_bytes,
        v_bytes_per_shard_layer_per_block=v_bytes,
        device_id=context.device_id if config.device_id is None else config.device_id,
        dp_id=config.dp_id,
        constructor=shape,
        attention_type=config.attention_type,
        # lines 155-164 and 201-211 of the same file: the K/V-constructor SDK's read and write
        read_kwargs={"remote_addrs": None} if kv_shape else {},
        write_kwargs={"h2h_copy": False, "params": None} if kv_shape else {},
    )
