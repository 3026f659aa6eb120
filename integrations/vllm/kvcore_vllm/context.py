"""The engine facts a kvcore backend is opened with: ranks and the backend context.

Shared by the scheduler side, the workers and the tools that name stored objects
(:mod:`kvcore_vllm.keys`); it imports none of them.
"""

from __future__ import annotations

from typing import Any

import kvcore
from kvcore_vllm.config import ConnectorSettings

__all__ = ["backend_context", "engine_world"]


def engine_world(vllm_config: Any) -> int:
    """Ranks holding distinct KV slices: tensor x pipeline parallel (data-parallel replicas
    share them: an engine replica's rank r stores exactly what another's rank r would)."""
    pc = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(pc, name, 1) or 1) > 1:
            raise ValueError(
                f"KVCoreConnector does not support context parallelism ({name} > 1): a block's "
                "tokens are split across ranks"
            )
    return int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)


def backend_context(
    settings: ConnectorSettings, layout: kvcore.CacheLayout, rank: int, world_size: int
) -> kvcore.BackendContext:
    context: dict[str, Any] = {
        "layout": layout,
        "rank": rank,
        "world_size": world_size,
        "namespace": settings.namespace,
    }
    if settings.weight_version:
        context["weight_version"] = settings.weight_version
    return kvcore.BackendContext.model_validate(context)
