"""Lazy access to the vendor SDK, so this package imports (and is listed) without it.

What is imported, and from where, follows FastDeploy's AttentionStore backend
(``fastdeploy/cache_manager/transfer_factory/mooncake_store/attention_store.py`` at
PaddlePaddle/FastDeploy@1af00818db85f4e844327e9ba5ccfacff1afe9bf, lines 31-37): the SDK class
and ``Tokens`` from ``attentionstore_sdk.sdk``, the error type from
``attentionstore_sdk.utils.err``, the media constants from
``attentionstore_sdk.api.common.common_pb2``, and - only for SDKs whose constructor takes
separate K and V sizes - ``AttentionType`` from ``attentionstore_sdk.client.client``.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Literal

SDK_MODULE = "attentionstore_sdk"
NOT_READY_MARKER = "cuda memory not ready"

#: The two constructor shapes FastDeploy has called (see :func:`detect_constructor`).
ConstructorShape = Literal["per_block_bytes", "kv_bytes"]

INSTALL_HINT = (
    "the 'attentionstore' kvcore backend needs the AttentionStore SDK (Python package "
    f"{SDK_MODULE!r}), which is not importable here. It is not published on PyPI: install "
    "the wheel your AttentionStore deployment provides (pip install attentionstore_sdk-*.whl) "
    "into this environment, or choose another backend"
)


class SdkMissingError(ImportError):
    """The SDK is not installed; the message says how to get it."""


@dataclass(frozen=True, slots=True)
class SdkModule:
    """The names the backend uses from the SDK."""

    sdk_class: Any
    tokens_class: Any
    error_class: type[BaseException]
    media_hbm: Any  # common_pb2.MEDIA_HBM: the device-memory medium of flush_token_index
    attention_type: Any | None  # client.client.AttentionType, absent from older SDKs


def load_sdk() -> SdkModule:
    """Import the SDK now; raise :class:`SdkMissingError` with install instructions if absent."""
    try:
        sdk = importlib.import_module(f"{SDK_MODULE}.sdk")
        err = importlib.import_module(f"{SDK_MODULE}.utils.err")
        common_pb2 = importlib.import_module(f"{SDK_MODULE}.api.common.common_pb2")
    except ImportError as exc:
        raise SdkMissingError(f"{INSTALL_HINT} ({exc})") from exc
    try:
        attention_type = importlib.import_module(f"{SDK_MODULE}.client.client").AttentionType
    except (ImportError, AttributeError):
        attention_type = None
    return SdkModule(
        sdk_class=sdk.AttentionStoreSDK,
        tokens_class=sdk.Tokens,
        error_class=err.AttentionStoreSDKError,
        media_hbm=common_pb2.MEDIA_HBM,
        attention_type=attention_type,
    )


def detect_constructor(sdk: SdkModule) -> ConstructorShape:
    """Which constructor the installed SDK has.

    FastDeploy picks by platform (CUDA: K and V sizes plus ``attention_type``,
    ``enable_as_kv_rw`` and ``gpu_count``; otherwise one size per block). We look at the SDK
    itself instead: a signature with ``attention_type`` or eleven positional parameters is the
    K/V one. A signature Python cannot read (a compiled class) falls back to FastDeploy's
    evidence: only SDKs with the K/V constructor ship ``client.client.AttentionType``.
    """
    try:
        params = list(inspect.signature(sdk.sdk_class).parameters.values())
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind is p.VAR_POSITIONAL for p in params):
        if any(p.name == "attention_type" for p in params):
            return "kv_bytes"
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return "kv_bytes" if len(positional) >= 11 else "per_block_bytes"
    return "kv_bytes" if sdk.attention_type is not None else "per_block_bytes"


def is_not_ready(exc: BaseException, sdk: SdkModule) -> bool:
    """Whether ``exc`` is the SDK saying its device memory is not registered yet."""
    return isinstance(exc, sdk.error_class) and NOT_READY_MARKER in str(exc)
