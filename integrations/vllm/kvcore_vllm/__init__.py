"""kvcore as a vLLM KV connector: any kvcore backend becomes vLLM's persistent prefix cache.

``KVCoreConnector`` is importable from here, so both ways vLLM finds a connector work:
by name (the ``vllm.general_plugins`` entry point registers it) and through
``"kv_connector_module_path": "kvcore_vllm"``. vLLM itself is imported only when the connector
class is first used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CONNECTOR_NAME", "KVCoreConnector"]

#: The name operators put in ``"kv_connector"``.
CONNECTOR_NAME = "KVCoreConnector"


def __getattr__(name: str) -> Any:
    if name == "KVCoreConnector":
        from kvcore_vllm.connector import KVCoreConnector

        return KVCoreConnector
    raise AttributeError(f"module 'kvcore_vllm' has no attribute {name!r}")
