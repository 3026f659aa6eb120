"""The secondary tier with the models people run: hybrid KV cache groups, MLA's replicated
layout and the canonical (TP-independent) host layout, as vLLM's tier tests drive a tier.

vLLM's offloading describes these models in its ``OffloadingConfig``: one ``OffloadKey`` per
block hash and KV cache group, ``replicated_layout`` for a pure-MLA model's single copy,
``is_parallelism_agnostic`` with ``canonical_layout`` for chunks whose bytes do not depend on
the TP degree. ``KVCoreTier`` keys chunks by vLLM's own run fields (those its ``fs`` tier names
its directory by), so these show what a kvcore tier shares and what it keeps apart:

- a hybrid model's groups are separate objects, each restored byte for byte, and a model with
  the same layers in one group (full attention everywhere) never finds them;
- an MLA chunk written at TP=2 is read at TP=1, and one written at TP=1 at TP=2;
- a canonical-layout chunk written by rank 1 of TP=2 is read at TP=1; a direct (per-rank)
  layout's chunks are not shared across TP degrees.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tier_helpers import aligned_tensor, drain, lookup_and_wait, make_job, make_tier, object_names
from tier_helpers import offloading_spec as spec
from vllm.v1.kv_offload.base import LookupResult, make_offload_key
from vllm.v1.kv_offload.config import OffloadingGroupConfig

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
#: a hybrid model's groups: full attention on even layers, a sliding window on odd ones
HYBRID = (
    OffloadingGroupConfig(tokens_per_block=16, layer_names=LAYERS[0::2], group_id=0),
    OffloadingGroupConfig(tokens_per_block=16, layer_names=LAYERS[1::2], group_id=1),
)
#: the same layers as one full-attention group
FULL = (OffloadingGroupConfig(tokens_per_block=16, layer_names=LAYERS, group_id=0),)


def chunk(n: int, group: int = 0):
    return make_offload_key(n.to_bytes(8, "big"), group)


def _round_trip(root: Path, writer_spec, reader_spec, keys, expect_hit: bool) -> None:
    """``keys`` stored from chunks 0.. of a writer's memory; the reader looks them up and,
    where it should find them, loads them into chunks 4.. of its own, byte for byte."""
    written = aligned_tensor(8, random=True)
    writer, _ = make_tier("file", str(root), written, spec=writer_spec)
    try:
        writer.submit_store(make_job(1, keys, list(range(len(keys)))))
        assert all(r.success for r in drain(writer))
    finally:
        writer.shutdown()
    read = aligned_tensor(8)
    reader, _ = make_tier("file", str(root), read, spec=reader_spec)
    try:
        found = lookup_and_wait(reader, keys)
        if not expect_hit:
            assert found == [LookupResult.MISS] * len(keys)
            return
        assert found == [LookupResult.HIT] * len(keys)
        targets = list(range(4, 4 + len(keys)))
        reader.submit_load(make_job(2, keys, targets, promotion=True))
        assert all(r.success for r in drain(reader))
        for i, target in enumerate(targets):
            assert torch.equal(read[target], written[i])
    finally:
        reader.shutdown()


def test_a_hybrid_models_groups_are_kept_apart_and_each_restored(tmp_path: Path) -> None:
    keys = [chunk(7, group=0), chunk(7, group=1)]  # one block hash, both groups
    _round_trip(tmp_path, spec(groups=HYBRID), spec(groups=HYBRID), keys, expect_hit=True)
    tier, _ = make_tier("file", str(tmp_path), spec=spec(groups=HYBRID))
    try:
        assert object_names(tier, keys[0]) != object_names(tier, keys[1])
    finally:
        tier.shutdown()
    # a full-attention model of the same layers and tokens finds neither group's chunk
    _round_trip(tmp_path / "full", spec(groups=HYBRID), spec(groups=FULL), keys, expect_hit=False)


def test_an_mla_chunk_is_shared_across_tp_sizes(tmp_path: Path) -> None:
    def mla(tp: int, rank: int):
        return spec(tp_size=tp, rank=rank, replicated_layout=True, groups=FULL)

    _round_trip(tmp_path / "2to1", mla(2, 1), mla(1, 0), [chunk(3)], expect_hit=True)
    _round_trip(tmp_path / "1to2", mla(1, 0), mla(2, 1), [chunk(4)], expect_hit=True)


def test_a_canonical_layout_is_shared_across_tp_sizes_and_a_direct_one_is_not(
    tmp_path: Path,
) -> None:
    def canonical(tp: int, rank: int):
        return spec(tp_size=tp, rank=rank, parallelism_agnostic=True, canonical_layout="LBNHC")

    _round_trip(tmp_path / "canon", canonical(2, 1), canonical(1, 0), [chunk(5)], expect_hit=True)
    # the direct layout: each rank's bytes are its own slice, so TP=1 must not read TP=2's
    _round_trip(
        tmp_path / "direct", spec(tp_size=2, rank=0), spec(tp_size=1), [chunk(6)], expect_hit=False
    )
