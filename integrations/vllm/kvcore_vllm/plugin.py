"""The ``vllm.general_plugins`` entry point: register ``KVCoreConnector`` and the ``kvcore``
secondary tier by name.

vLLM calls this in every process it starts (possibly more than once per process), before it
builds connectors and tiers; registering lazily keeps vLLM from importing either until used.
"""

from __future__ import annotations

import contextlib

from kvcore_vllm import CONNECTOR_NAME, TIER_TYPE

__all__ = ["register"]


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    # vLLM loads plugins more than once per process; a second registration raises ValueError
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "kvcore_vllm.connector", "KVCoreConnector"
        )
    with contextlib.suppress(ValueError):
        SecondaryTierFactory.register_tier(TIER_TYPE, "kvcore_vllm.tier", "KVCoreTier")
