"""kvcore's key-identity kit on the LMCache L2 adapter, with LMCache's own keys.

LMCache keys a chunk by ``ObjectKey``: the rolling hash of the prompt's token ids (LMCache's
own ``TokenHasher``), the model name, the ``kv_rank`` (world size and rank), the object group
and the request's ``cache_salt``. The request axis LMCache carries is ``cache_salt``; the
engine axes are the model name, the parallel slice (``kv_rank``), the object group, and the
KV dtype, which LMCache's key does not carry: the adapter keeps chunks of another dtype apart
by the layout stored with each object. LoRA, multimodal items and prompt embeddings are not
in LMCache's keys at all (docs/lmcache.md says what a user must do), so they are not axes.

Stored chunks go through one adapter (a "server") of the base configuration; each probe is
answered by a fresh adapter of its configuration over the same kv_file store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from conftest import load, lookup, memory_obj, store
from kvcore_lmcache.l2 import KVCoreL2Adapter
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.multiprocess.token_hasher import TokenHasher

from kvcore.testing.identity import IdentityDriver, Request, Served, run_identity_kit

CHUNK = 16
ELEMENTS = 512  # per chunk object: 1 KiB in fp16 and bf16 alike


@dataclass(frozen=True)
class Engine:
    model: str = "org/tiny"
    kv_rank: int = ObjectKey.ComputeKVRank(1, 0, 1, 0)
    group: int = 0
    dtype: torch.dtype = torch.float16


ENGINES = {
    "base": Engine(),
    "model": Engine(model="org/tiny-instruct"),
    "tp_slice": Engine(kv_rank=ObjectKey.ComputeKVRank(2, 0, 2, 0)),
    "object_group": Engine(group=1),
    "kv_dtype": Engine(dtype=torch.bfloat16),
}


class LMCacheDriver(IdentityDriver):
    name = "lmcache L2 adapter (LMCache's ObjectKey and TokenHasher)"
    request_axes = frozenset({"cache_salt"})
    engine_variants = {axis: axis for axis in ENGINES if axis != "base"}
    prompt_tokens = 4 * CHUNK + 5

    def __init__(self, root: Path, **adapter_params: object) -> None:
        self.root = root
        self.params = adapter_params
        self.hasher = TokenHasher(chunk_size=CHUNK)

    def adapter(self) -> KVCoreL2Adapter:
        params = {"backend": "file", "backend_config": {"root": str(self.root)}, **self.params}
        return KVCoreL2Adapter(params)

    def keys(self, request: Request, engine: Engine) -> list[ObjectKey]:
        return [
            ObjectKey(
                chunk_hash=h,
                model_name=engine.model,
                kv_rank=engine.kv_rank,
                object_group_id=engine.group,
                cache_salt=request.cache_salt or "",
            )
            for h in self.hasher.compute_chunk_hashes(list(request.tokens))
        ]

    def serve(self, stored: Sequence[Request], probes: Sequence[Request]) -> Mapping[str, Served]:
        writer = self.adapter()
        gen = torch.Generator().manual_seed(1)
        try:
            for request in stored:
                keys = self.keys(request, ENGINES[request.engine])
                objs = [memory_obj(torch.randn(ELEMENTS, generator=gen).half()) for _ in keys]
                assert store(writer, keys, objs).is_successful()
        finally:
            writer.close()
        out: dict[str, Served] = {}
        for probe in probes:
            engine = ENGINES[probe.engine]
            reader = self.adapter()  # a fresh server of the probe's configuration
            try:
                keys = self.keys(probe, engine)
                found = lookup(reader, keys)
                leading = next((i for i in range(len(keys)) if i not in found), len(keys))
                bufs = [memory_obj(n=ELEMENTS, dtype=engine.dtype) for _ in keys[:leading]]
                loaded = load(reader, keys[:leading], bufs) if leading else []
                restored = next((i for i in range(leading) if i not in loaded), leading)
                reader.submit_unlock(keys[:leading])
            finally:
                reader.close()
            out[probe.id] = Served(restored * CHUNK, len(keys) * CHUNK)
        return out


class SaltBlindDriver(LMCacheDriver):
    """A broken adapter: the tenant's salt dropped from the keys."""

    def keys(self, request: Request, engine: Engine) -> list[ObjectKey]:
        return super().keys(replace(request, cache_salt=None), engine)


def test_lmcache_keys_through_the_adapter_keep_every_identity_apart(tmp_path):
    report = run_identity_kit(LMCacheDriver(tmp_path / "store"))
    assert not report.failures, report.summary()
    assert report.by_axis() == {
        "same": 1,
        "cache_salt": 4,
        "model": 1,
        "tp_slice": 1,
        "object_group": 1,
        "kv_dtype": 1,
    }


@pytest.mark.parametrize(
    "driver,axis",
    [
        (lambda root: SaltBlindDriver(root), "cache_salt"),
        # without the stored layout, same-size KV of another dtype would be served
        (lambda root: LMCacheDriver(root, verify_layout=False), "kv_dtype"),
    ],
)
def test_the_kit_catches_an_adapter_that_loses_an_identity(tmp_path, driver, axis):
    report = run_identity_kit(driver(tmp_path / "store"))
    assert axis in report.failed_axes(), report.summary()
