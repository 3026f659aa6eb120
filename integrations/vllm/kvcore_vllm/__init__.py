"""kvcore for vLLM: any kvcore backend as vLLM's persistent prefix cache, two ways.

``KVCoreConnector`` (a KV connector that stores vLLM's blocks itself) and ``KVCoreTier`` (a
secondary tier under vLLM's own CPU offloading, ``TieringOffloadingSpec``).

``KVCoreConnector`` is importable from here, so both ways vLLM finds a connector work:
by name (the ``vllm.general_plugins`` entry point registers it) and through
``"kv_connector_module_path": "kvcore_vllm"``. vLLM itself is imported only when the connector
class is first used.
"""

from __future__ import annotations

from typing import Any

from kvcore.versions import installed_version

__all__ = ["CONNECTOR_NAME", "TIER_TYPE", "KVCoreConnector", "KVCoreTier", "__version__"]

__version__ = installed_version("kvcore-vllm")

#: The name operators put in ``"kv_connector"``.
CONNECTOR_NAME = "KVCoreConnector"
#: The ``type`` operators put in a ``secondary_tiers`` entry of vLLM's TieringOffloadingSpec.
TIER_TYPE = "kvcore"


def __getattr__(name: str) -> Any:
    if name == "KVCoreConnector":
        from kvcore_vllm.connector import KVCoreConnector

        return KVCoreConnector
    if name == "KVCoreTier":
        from kvcore_vllm.tier import KVCoreTier

        return KVCoreTier
    raise AttributeError(f"module 'kvcore_vllm' has no attribute {name!r}")
