"""kvcore-mooncake: a kvcore backend that keeps KV-cache blocks in a Mooncake Store cluster.

Open it with ``kvcore.open_backend("mooncake", {"master_server_address": "host:port"})``.
Test helpers (a real ``mooncake_master`` on loopback, pytest fixtures) are in
:mod:`kv_mooncake.testing`.

The names below are imported when first used: the package's pytest plugin
(:mod:`kv_mooncake.testing`, loaded by every pytest run where kvcore-mooncake is installed)
imports this package, and must not import kvcore with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_mooncake.backend import MooncakeBackend
    from kv_mooncake.config import MooncakeConfig
    from kv_mooncake.connect import MasterUnreachableError, MooncakeSetupError

__all__ = [
    "MasterUnreachableError",
    "MooncakeBackend",
    "MooncakeConfig",
    "MooncakeSetupError",
    "__version__",
]

_WHERE = {
    "MooncakeBackend": "kv_mooncake.backend",
    "MooncakeConfig": "kv_mooncake.config",
    "MasterUnreachableError": "kv_mooncake.connect",
    "MooncakeSetupError": "kv_mooncake.connect",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from kvcore.versions import installed_version

        return installed_version("kvcore-mooncake")
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kv_mooncake' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
