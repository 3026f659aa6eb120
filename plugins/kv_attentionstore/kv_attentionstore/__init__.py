"""kvcore backend for AttentionStore (entry point ``attentionstore``).

Importing this package never imports the vendor SDK: it is loaded when the backend opens, so
``kvcore`` can list this backend, and open every other one, on machines without the SDK.
"""

from kv_attentionstore.backend import AttentionStoreBackend
from kv_attentionstore.config import (
    FASTDEPLOY_ALIASES,
    AttentionStoreConfig,
    SdkSettings,
    resolve_settings,
)
from kv_attentionstore.readiness import SdkNotReadyError, SdkStartError
from kv_attentionstore.sdk_loader import SdkMissingError, detect_constructor
from kvcore.versions import installed_version

__all__ = [
    "FASTDEPLOY_ALIASES",
    "AttentionStoreBackend",
    "AttentionStoreConfig",
    "SdkMissingError",
    "SdkNotReadyError",
    "SdkSettings",
    "SdkStartError",
    "__version__",
    "detect_constructor",
    "resolve_settings",
]

__version__ = installed_version("kvcore-attentionstore")
