"""The ``vllm.general_plugins`` entry point: register ``KVCoreConnector`` by name.

vLLM calls this in every process it starts (possibly more than once per process), before it
builds connectors; registering lazily keeps vLLM from importing the connector until used.
"""

from __future__ import annotations

import contextlib

from kvcore_vllm import CONNECTOR_NAME

__all__ = ["register"]


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # vLLM loads plugins more than once per process; a second registration raises ValueError
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "kvcore_vllm.connector", "KVCoreConnector"
        )
