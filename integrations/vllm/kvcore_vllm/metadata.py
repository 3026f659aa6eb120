"""What the scheduler-side connector tells the workers each step (plain, picklable data)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["BlockRun", "StepMetadata"]


@dataclass
class BlockRun:
    """Blocks ``start_block .. start_block + len(keys) - 1`` of one request.

    ``block_ids`` are vLLM's block ids holding them, in KV cache group ``group``. ``token_ids`` is
    the token path from the first token through the last block, sent only to token-addressed
    backends.
    """

    req_id: str
    start_block: int
    keys: list[str]
    block_ids: list[int]
    token_ids: list[int] | None = None
    #: the KV cache group (vLLM's index) these blocks are of
    group: int = 0
    #: saves: each block's descriptor (:mod:`kvcore_vllm.descriptors`), stored with it where
    #: the backend keeps block metadata
    block_meta: list[bytes] | None = None
    #: loads: how long the load-or-recompute decision expected it to take (None: not paced);
    #: a load behind it is cut and the rest recomputed (:class:`kvcore.ReadTask`)
    expected_s: float | None = None
    #: ...and the read time at which it ties with recomputing: a load whose rate says it
    #: would end past it is cut the same way (:attr:`kvcore.ReadTask.break_even_s`)
    break_even_s: float | None = None
    #: whose request it is (``settings.tenants``; None: no tenants set), its tasks' tenant
    tenant: str | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


@dataclass
class StepMetadata(KVConnectorMetadata):
    """One scheduler step's work.

    - ``loads``: runs to restore before this step's forward pass (the scheduler already counted
      them as computed);
    - ``saves``: runs that become full blocks during this step, stored after it;
    - ``preempted``: requests whose blocks vLLM is about to reuse (their saves must finish);
    - ``async_loads``: the loads run in the background, each request answered through
      ``get_finished`` when all of its runs are in (else they finish before the forward pass).
    """

    loads: list[BlockRun] = field(default_factory=list)
    async_loads: bool = False
    saves: list[BlockRun] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
