"""What the secondary-tier tests share: vLLM's offloading spec as vLLM's own tier tests build
it, primary-tier memory, jobs, and a ``KVCoreTier`` over ``file`` or ``memory``.

vLLM's tier tests (``tests/v1/kv_offload/tiering/``) build the spec as a ``MagicMock`` holding
a real ``OffloadingConfig``, and a page-aligned CPU tensor as the primary tier's memory; the
tests here do the same, so the tier sees exactly what vLLM's tests give vLLM's tiers.
"""

from __future__ import annotations

import contextlib
import mmap
import time
from collections.abc import Iterator
from typing import Any
from unittest.mock import MagicMock

import numpy as np
import torch
from kvcore_vllm.tier import KVCoreTier
from vllm.plugins import load_general_plugins
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

# what vLLM does in every process it starts: run the `vllm.general_plugins` entry points, one
# of which (this package's) registers the tier's short name "kvcore"
load_general_plugins()

#: chunks of the primary tier in the tests' tensors
NUM_CHUNKS = 8
#: 128 KiB per chunk (vLLM's tests use 2 MiB; smaller keeps 2 cores fast, same code paths)
CHUNK_ELEMENTS = 8 * mmap.PAGESIZE
CTX = ReqContext(req_id="test")
BACKENDS = ("file", "memory")


def offloading_spec(
    enable_kv_cache_events: bool = False,
    *,
    tp_size: int = 1,
    rank: int = 0,
    replicated_layout: bool = False,
    model: str = "test-model",
    groups: tuple[Any, ...] = (),
    parallelism_agnostic: bool = False,
    canonical_layout: str | None = None,
) -> MagicMock:
    """vLLM's offloading spec as its tier tests build it: a real ``OffloadingConfig``
    (``groups``: a tuple of ``OffloadingGroupConfig``; ``canonical_layout``: the KV cache layout of a
    canonical host layout, e.g. ``"NHD"``)."""
    spec = MagicMock()
    spec.config = OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=enable_kv_cache_events,
        extra_config={},
        engine_id="test-engine",
        model=OffloadingModelConfig(name=model, dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=parallelism_agnostic,
        ),
        replicated_layout=replicated_layout,
        canonical_layout=canonical_layout is not None,
        kv_cache_layout=canonical_layout,
    )
    spec.blocks_per_chunk = 1
    spec.kv_events_config = OffloadingKVEventsConfig(
        enable_kv_cache_events=enable_kv_cache_events, self_describing_kv_events=False
    )
    return spec


def key(n: int) -> OffloadKey:
    return make_offload_key(n.to_bytes(8, "big"), 0)


def make_job(
    job_id: int, keys: list[OffloadKey], chunk_ids: list[int] | None = None, promotion=False
) -> TransferJob:
    ids = list(range(len(keys))) if chunk_ids is None else chunk_ids
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(ids, dtype=np.int64),
        is_promotion=promotion,
        req_context=CTX,
    )


def aligned_tensor(num_chunks: int = NUM_CHUNKS, random: bool = False) -> torch.Tensor:
    """Page-aligned float32 chunks, as the primary tier's mapped memory is."""
    nbytes = num_chunks * CHUNK_ELEMENTS * 4
    raw = torch.zeros(nbytes + mmap.PAGESIZE, dtype=torch.uint8)
    shift = -raw.data_ptr() % mmap.PAGESIZE
    t = raw[shift : shift + nbytes].view(torch.float32).view(num_chunks, CHUNK_ELEMENTS)
    if random:
        t[:] = torch.rand(num_chunks, CHUNK_ELEMENTS)
    return t


def backend_settings(backend: str, root: str, **config: Any) -> dict[str, Any]:
    """The ``secondary_tiers`` entry's kvcore settings for ``backend``."""
    if backend == "file":
        return {"backend": "file", "backend_config": {"root": root, **config}}
    return {"backend": backend, "backend_config": dict(config)}


def make_tier(
    backend: str,
    root: str,
    tensor: torch.Tensor | None = None,
    spec: Any = None,
    **settings: Any,
) -> tuple[KVCoreTier, torch.Tensor]:
    tensor = aligned_tensor() if tensor is None else tensor
    settings = {**backend_settings(backend, root), **settings}
    tier = KVCoreTier(
        offloading_spec=spec or offloading_spec(),
        primary_kv_view=memoryview(tensor.numpy()),
        tier_type="kvcore",
        **settings,
    )
    return tier, tensor


def drain(tier: KVCoreTier) -> list[JobResult]:
    """Wait for every job, then collect the results."""
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def lookup_and_wait(
    tier: KVCoreTier, keys: list[OffloadKey], ctx: ReqContext = CTX, timeout: float = 5.0
) -> list[LookupResult]:
    """One asynchronous lookup round, as the scheduler makes it: ask, end the step, ask again."""
    for k in keys:
        tier.lookup(k, ctx)
    tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and tier._lookups._pending_results.empty():
        time.sleep(0.01)
    return [tier.lookup(k, ctx) for k in keys]


def stored(tier: KVCoreTier, k: OffloadKey) -> bool:
    """Whether the tier's store holds chunk ``k`` (what vLLM's fs tests check as a file)."""
    return tier.store.query(tier._request("probe", [k], None, tier.store, 5.0)) == 1


def object_names(tier: KVCoreTier, k: OffloadKey) -> tuple[str, ...]:
    return tuple(tier._request("names", [k], None, tier.store, 5.0).object_names[0])


def damage(tier: KVCoreTier, k: OffloadKey, how: str = "truncate") -> None:
    """Corrupt the stored chunk ``k``: ``truncate`` its file to 10 bytes (kv_file), or flip
    a bit of the stored object (``memory``, Mooncake: kvcore.testing.corruption)."""
    (name,) = object_names(tier, k)
    plugin = tier.backend.plugin
    if tier.backend.name == "file":
        from kv_file.objfile import encode_name
        from kv_file.paths import name_digest

        path = plugin._dir.object_path(name_digest(encode_name(name)))
        if how == "truncate":
            with open(path, "wb") as f:
                f.write(b"x" * 10)
        else:
            with open(path, "r+b") as f:
                f.seek(-100, 2)
                byte = f.read(1)
                f.seek(-100, 2)
                f.write(bytes([byte[0] ^ 0x01]))
    else:  # memory, Mooncake: through the backend's own hooks, below kvcore's digests
        from kvcore.testing.corruption import flip_a_stored_bit

        flip_a_stored_bit(tier.backend, name, tier._chunk_bytes, at=tier._chunk_bytes - 100)


@contextlib.contextmanager
def engine_config(model_dir: Any, **engine_args: Any) -> Iterator[Any]:
    """A real ``VllmConfig`` of ``model_dir`` as vLLM's current config: what a tier built in an
    engine sees (its model settings go into the chunk keys' scope)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    args = {"model": str(model_dir), "skip_tokenizer_init": True, "max_model_len": 2048}
    config = EngineArgs(**{**args, **engine_args}).create_engine_config()
    with set_current_vllm_config(config):
        yield config
