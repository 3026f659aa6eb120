"""kvcore for FastDeploy: any kvcore backend behind FastDeploy's own storage calls.

``KVCoreStore`` speaks the calling convention of FastDeploy's cache transfer manager
(``query`` / ``batch_get`` / ``batch_set`` / ``register_buffer`` / ``exists`` / ``clear``) over a
kvcore backend opened by name, storing under FastDeploy's own object names in FastDeploy's
staging layout. With the patch in ``patches/`` a deployment selects it with
``--kvcache-storage-backend kvcore:<name>``; see ``docs/fastdeploy.md``.
"""

from kvcore.versions import installed_version
from kvcore_fastdeploy.layout import layout_from_fastdeploy
from kvcore_fastdeploy.names import PART_SUFFIXES, fastdeploy_names, part_of
from kvcore_fastdeploy.settings import (
    BACKEND_PREFIX,
    EXTRA_CONFIG_ENV,
    FASTDEPLOY_MOONCAKE_ENV,
    fastdeploy_backend_config,
    parse_backend_spec,
)
from kvcore_fastdeploy.store import FAILED, NOT_FOUND, KVCoreStore

__all__ = [
    "BACKEND_PREFIX",
    "EXTRA_CONFIG_ENV",
    "FAILED",
    "FASTDEPLOY_MOONCAKE_ENV",
    "NOT_FOUND",
    "PART_SUFFIXES",
    "KVCoreStore",
    "__version__",
    "fastdeploy_backend_config",
    "fastdeploy_names",
    "layout_from_fastdeploy",
    "parse_backend_spec",
    "part_of",
]

__version__ = installed_version("kvcore-fastdeploy")
