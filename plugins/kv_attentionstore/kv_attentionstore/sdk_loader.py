"""Lazy access to the vendor SDK, so this package imports (and is listed) without it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

SDK_MODULE = "attentionstore_sdk"
NOT_READY_MARKER = "cuda memory not ready"

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
    """The three names the backend uses from the SDK."""

    sdk_class: Any
    tokens_class: Any
    error_class: type[BaseException]


def load_sdk() -> SdkModule:
    """Import the SDK now; raise :class:`SdkMissingError` with install instructions if absent."""
    try:
        sdk = importlib.import_module(f"{SDK_MODULE}.sdk")
        err = importlib.import_module(f"{SDK_MODULE}.utils.err")
    except ImportError as exc:
        raise SdkMissingError(f"{INSTALL_HINT} ({exc})") from exc
    return SdkModule(sdk.AttentionStoreSDK, sdk.Tokens, err.AttentionStoreSDKError)


def is_not_ready(exc: BaseException, sdk: SdkModule) -> bool:
    """Whether ``exc`` is the SDK saying its device memory is not registered yet."""
    return isinstance(exc, sdk.error_class) and NOT_READY_MARKER in str(exc)
