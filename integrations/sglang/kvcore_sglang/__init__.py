"""kvcore as SGLang's HiCache storage tier: one ``HiCacheStorage`` for every kvcore backend.

Select it with ``--hicache-storage-backend dynamic`` and the extra config::

    {"backend_name": "kvcore", "module_path": "kvcore_sglang",
     "class_name": "KVCoreHiCacheStorage", "interface_v1": 1,
     "backend": "file", "backend_config": {"root": "/nvme/kvcore"}}

The storage class imports SGLang (and torch); ``kvcore_sglang.settings`` does not.
"""

from __future__ import annotations

from typing import Any

from kvcore.versions import installed_version

__all__ = ["EXTRA_CONFIG", "KVCoreHiCacheStorage", "__version__"]

__version__ = installed_version("kvcore-sglang")

#: The loader keys SGLang's ``dynamic`` backend needs to build this class.
EXTRA_CONFIG: dict[str, Any] = {
    "backend_name": "kvcore",
    "module_path": "kvcore_sglang",
    "class_name": "KVCoreHiCacheStorage",
    "interface_v1": 1,
}


def __getattr__(name: str) -> Any:
    # SGLang's factory does getattr(module, class_name): import the SGLang-bound class lazily
    if name == "KVCoreHiCacheStorage":
        from kvcore_sglang.storage import KVCoreHiCacheStorage

        return KVCoreHiCacheStorage
    raise AttributeError(f"module 'kvcore_sglang' has no attribute {name!r}")
