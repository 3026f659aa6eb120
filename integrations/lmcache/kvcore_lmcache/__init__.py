"""kvcore inside LMCache: any kvcore backend as LMCache's L2 storage.

Multiprocess mode (``lmcache server``)::

    --l2-adapter '{"type": "plugin", "module_path": "kvcore_lmcache.l2",
                   "class_name": "KVCoreL2Adapter",
                   "adapter_params": {"backend": "file",
                                      "backend_config": {"root": "/nvme/kvcore"}}}'

In-process LMCache: ``kvcore_lmcache.plugin.KVCoreStoragePlugin`` as a storage plugin.

``kvcore_lmcache.l2`` and ``kvcore_lmcache.plugin`` import LMCache (and torch); this package,
``settings``, ``keys``, ``layouts`` and ``store`` do not.
"""

from __future__ import annotations

from typing import Any

from kvcore.versions import installed_version

__all__ = ["L2_ADAPTER", "__version__", "l2_adapter_spec"]

__version__ = installed_version("kvcore-lmcache")


def l2_adapter_spec(backend: str = "file", **adapter_params: Any) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON object (as a dict) selecting the kvcore adapter over
    ``backend``; ``adapter_params`` are :class:`kvcore_lmcache.settings.AdapterSettings`."""
    return {
        "type": "plugin",
        "module_path": "kvcore_lmcache.l2",
        "class_name": "KVCoreL2Adapter",
        "adapter_params": {"backend": backend, **adapter_params},
    }


#: The loader keys of LMCache's ``plugin`` L2 adapter type for this package.
L2_ADAPTER: dict[str, Any] = {
    key: value for key, value in l2_adapter_spec().items() if key != "adapter_params"
}
