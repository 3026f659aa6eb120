"""The engine facts a kvcore backend is opened with: ranks and the backend context.

Shared by the scheduler side, the workers and the tools that name stored objects
(:mod:`kvcore_vllm.keys`); it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kvcore
from kvcore_vllm.config import ConnectorSettings

__all__ = [
    "HeadSlices",
    "Slice",
    "SlicePlan",
    "StoredRanks",
    "backend_context",
    "engine_world",
    "slice_plan",
    "stored_ranks",
]


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
class Slice:
    """One slice of every block a worker stores or restores: the ``r<rank>of<world>`` of its
    objects' names, which of the worker's own pieces holds it (``local``: a KV head on this
    rank, 0 where the rank holds one piece), and whether this worker writes it."""

    rank: int
    world: int
    local: int = 0
    writes: bool = True


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

    def slices(self, engine_rank: int) -> list[Slice]:
        """What ``engine_rank`` stores and restores: its one slice."""
        rank = self.object_rank(engine_rank)
        return [Slice(rank, self.world, 0, self.writes(engine_rank))]

    def all_slices(self) -> list[Slice]:
        """Every slice of a block: a block is restorable when each of them is stored."""
        return [Slice(r, self.world) for r in range(self.world)]

    @property
    def pieces(self) -> int:
        """How many pieces (KV heads) of a block each rank keeps apart: one."""
        return 1


@dataclass(frozen=True)
class HeadSlices:
    """The TP-independent layout: one slice per KV head of the model, per pipeline stage.

    Object ranks are ``pp_rank * kv_heads + head`` of ``pp_size * kv_heads``, whatever the TP
    degree. A TP rank holds ``kv_heads // tp`` heads (each a slice it writes and reads); with
    more TP ranks than KV heads, vLLM gives every rank one head and ``tp // kv_heads`` ranks
    hold each, of which the first writes it.
    """

    kv_heads: int
    tp: int
    pp: int

    @property
    def world(self) -> int:
        """The world size in object names: every stage's KV heads."""
        return self.pp * self.kv_heads

    @property
    def pieces(self) -> int:
        """KV heads on each rank."""
        return max(1, self.kv_heads // self.tp)

    def slices(self, engine_rank: int) -> list[Slice]:
        stage, tp_rank = divmod(engine_rank, self.tp)
        world, base = self.world, stage * self.kv_heads
        if self.tp <= self.kv_heads:
            first = tp_rank * self.pieces
            return [Slice(base + first + j, world, j) for j in range(self.pieces)]
        replicas = self.tp // self.kv_heads
        head, copy = divmod(tp_rank, replicas)
        return [Slice(base + head, world, 0, copy == 0)]

    def all_slices(self) -> list[Slice]:
        return [Slice(r, self.world) for r in range(self.world)]


#: How an engine's ranks map to stored slices.
SlicePlan = StoredRanks | HeadSlices


def stored_ranks(vllm_config: Any, replicated: bool) -> StoredRanks:
    """The engine's :class:`StoredRanks`; ``replicated``: every TP rank holds the same cache
    (:func:`kvcore_vllm.layout.replicated_across_tp`)."""
    world = engine_world(vllm_config)
    if not replicated:
        return StoredRanks(world)
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    return StoredRanks(world // tp, tp)


def slice_plan(vllm_config: Any, replicated: bool, per_head: bool) -> SlicePlan:
    """Which slices each rank stores: per rank, once for a replicated cache (MLA), or per KV
    head when the operator chose the TP-independent layout (``object_layout: per_head``)."""
    if replicated or not per_head:
        return stored_ranks(vllm_config, replicated)
    engine_world(vllm_config)  # refuses context parallelism
    pc, mc = vllm_config.parallel_config, vllm_config.model_config
    return HeadSlices(
        kv_heads=int(mc.get_total_num_kv_heads()),
        tp=int(pc.tensor_parallel_size),
        pp=int(pc.pipeline_parallel_size),
    )


def backend_context(
    settings: ConnectorSettings,
    layout: kvcore.CacheLayout,
    rank: int,
    world_size: int,
    role: str = "data",
) -> kvcore.BackendContext:
    """The context a backend is opened with: ``role`` ``lookup`` for a scheduler whose
    workers run in other processes (it only asks what is stored)."""
    context: dict[str, Any] = {
        "layout": layout,
        "rank": rank,
        "world_size": world_size,
        "namespace": settings.namespace,
        "role": role,
    }
    if settings.weight_version:
        context["weight_version"] = settings.weight_version
    return kvcore.BackendContext.model_validate(context)
