"""kvcore: the third tier of an LLM serving engine's KV cache, as a plugin framework.

Engine authors open a backend by name (:func:`open_backend`) or embed a
:class:`kvcore.transfer.TransferManager`; backend authors implement the hooks in
:mod:`kvcore.hookspecs` and test them with :mod:`kvcore.testing`.
"""

from __future__ import annotations

from kvcore.backend import Backend
from kvcore.config import BackendConfig
from kvcore.errors import (
    BackendDefinitionError,
    BackendImportError,
    ConfigError,
    DuplicateBackendError,
    KVCoreError,
    UnknownBackendError,
)
from kvcore.handles import BackendHandle
from kvcore.hookspecs import hookimpl, hookspec
from kvcore.keys import KeyScope, block_hashes, object_names
from kvcore.metrics import Counters, OnceLogger
from kvcore.registry import available_backends, check_backend_config, open_backend
from kvcore.requests import (
    MAX_BLOCK_META_BYTES,
    BlockRequest,
    DeviceBuffers,
    FailureKind,
    HostBuffers,
    Outcome,
    Presence,
    leading_run,
)
from kvcore.runner import HostResult, HostRunner
from kvcore.schemas import BackendContext, ByteSize, CacheDType, CacheLayout, Capabilities
from kvcore.tasks import FlushTask, QueryTask, ReadTask, SwapTask, TaskResult, WriteTask
from kvcore.versions import installed_version as _installed_version

__version__ = _installed_version("kvcore")

__all__ = [
    "MAX_BLOCK_META_BYTES",
    "Backend",
    "BackendConfig",
    "BackendContext",
    "BackendDefinitionError",
    "BackendHandle",
    "BackendImportError",
    "BlockRequest",
    "ByteSize",
    "CacheDType",
    "CacheLayout",
    "Capabilities",
    "ConfigError",
    "Counters",
    "DeviceBuffers",
    "DuplicateBackendError",
    "FailureKind",
    "FlushTask",
    "HostBuffers",
    "HostResult",
    "HostRunner",
    "KVCoreError",
    "KeyScope",
    "OnceLogger",
    "Outcome",
    "Presence",
    "QueryTask",
    "ReadTask",
    "SwapTask",
    "TaskResult",
    "UnknownBackendError",
    "WriteTask",
    "available_backends",
    "block_hashes",
    "check_backend_config",
    "hookimpl",
    "hookspec",
    "leading_run",
    "object_names",
    "open_backend",
]
