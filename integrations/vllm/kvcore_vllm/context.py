"""The engine facts a kvcore backend is opened with: ranks and the backend context.

Shared by the scheduler side, the workers and the tools that name stored objects
(:mod:`kvcore_vllm.keys`); it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kvcore
from kvcore_vllm.config import ConnectorSettings

__all__ = ["StoredRanks", "backend_context", "engine_world", "stored_ranks"]


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


@dataclass(frozen=True)
class StoredRanks:
    """Which stored objects each of the engine's ranks writes and reads.

    ``world`` is the number of distinct slices (the world size in object names). Each slice
    is held by ``replicas`` consecutive engine ranks (the TP ranks of a pipeline stage, for a
    cache every TP rank holds whole: MLA's latent) that all read it; the first of them alone
    writes it, so a block is stored once, whatever the TP degree, and engines of any TP degree
    read it. Without replication (``replicas`` 1) every rank writes and reads its own slice.
    Engine ranks count TP fastest: ``pp_rank * tp_size + tp_rank``.
    """

    world: int
    replicas: int = 1

    def object_rank(self, engine_rank: int) -> int:
        """The rank in the object names ``engine_rank`` reads and writes."""
        return engine_rank // self.replicas

    def writes(self, engine_rank: int) -> bool:
        """Whether ``engine_rank`` stores its slice (one rank of each slice's replicas)."""
        return engine_rank % self.replicas == 0


def stored_ranks(vllm_config: Any, replicated: bool) -> StoredRanks:
    """The engine's :class:`StoredRanks`; ``replicated``: every TP rank holds the same cache
    (:func:`kvcore_vllm.layout.replicated_across_tp`)."""
    world = engine_world(vllm_config)
    if not replicated:
        return StoredRanks(world)
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    return StoredRanks(world // tp, tp)


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
