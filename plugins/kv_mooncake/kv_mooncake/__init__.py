"""kvcore-mooncake: a kvcore backend that keeps KV-cache blocks in a Mooncake Store cluster.

Open it with ``kvcore.open_backend("mooncake", {"master_server_address": "host:port"})``.
Test helpers (a real ``mooncake_master`` on loopback, pytest fixtures) are in
:mod:`kv_mooncake.testing`.
"""

from kv_mooncake.backend import MooncakeBackend
from kv_mooncake.config import MooncakeConfig
from kv_mooncake.connect import MasterUnreachableError, MooncakeSetupError
from kvcore.versions import installed_version

__all__ = [
    "MasterUnreachableError",
    "MooncakeBackend",
    "MooncakeConfig",
    "MooncakeSetupError",
    "__version__",
]

__version__ = installed_version("kvcore-mooncake")
