"""kvcore's key-identity kit on FastDeploy's storage calls.

FastDeploy names a block's objects ``prefix{weight version}_{block hash}_{rank}_key`` (and
``_value``, scales): the block hash is FastDeploy's own (its prefix cache's chained hash, with
what FastDeploy puts in it), opaque to the adapter, so the kit's request-level parts are
FastDeploy's to carry and none is declared here. What the adapter's stores must keep apart is
the rest: the RL weight version (FastDeploy's key prefix), the model (FastDeploy's model id is
the namespace), the TP degree and the cache dtype (neither is in FastDeploy's names).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from conftest import CACHE
from kvcore_fastdeploy import KVCoreStore, fastdeploy_names

from kvcore.testing.identity import IdentityDriver, Request, Served, run_identity_kit

BLOCK = CACHE["key_cache_shape"][2]


class FastDeployDriver(IdentityDriver):
    name = "fastdeploy adapter (FastDeploy's names and calls)"
    request_axes = frozenset()
    prompt_tokens = 4 * BLOCK + 3

    def __init__(
        self, open_store: Callable[..., KVCoreStore], engines: Mapping[str, dict[str, Any]]
    ) -> None:
        self.open_store = open_store
        self.engines = engines  # name -> {"open": {...}, "key_prefix": str}
        self.engine_variants = {k: k for k in engines if k != "base"}

    @staticmethod
    def block_hashes(request: Request) -> list[str]:
        """A chained hash per full block, as FastDeploy's prefix cache names blocks."""
        out, parent = [], b""
        for i in range(len(request.tokens) // BLOCK):
            block = request.tokens[i * BLOCK : (i + 1) * BLOCK]
            parent = hashlib.sha256(parent + repr(block).encode()).digest()
            out.append(parent.hex())
        return out

    def _names(self, engine: str, request: Request) -> dict[str, list[str]]:
        prefix = self.engines[engine].get("key_prefix", "")
        return fastdeploy_names(self.block_hashes(request), 0, key_prefix=prefix)

    def serve(self, stored: Sequence[Request], probes: Sequence[Request]) -> Mapping[str, Served]:
        writer = self.open_store("file", **self.engines["base"].get("open", {}))
        for request in stored:
            names = self._names("base", request)
            n = len(names["k"])
            sizes = [writer.layout.part_bytes(p) for p in ("k", "v") for _ in range(n)]
            arrays = [np.full(size, 3, np.uint8) for size in sizes]
            answers = writer.batch_set(
                names["k"] + names["v"], [a.ctypes.data for a in arrays], sizes
            )
            assert answers == [0] * (2 * n), answers
        writer.close()
        out: dict[str, Served] = {}
        for engine in sorted({p.engine for p in probes}):
            reader = self.open_store("file", **self.engines[engine].get("open", {}))
            for probe in (p for p in probes if p.engine == engine):
                names = self._names(engine, probe)
                found = reader.query(names["k"], names["v"])
                out[probe.id] = Served(found * BLOCK, len(names["k"]) * BLOCK)
            reader.close()
        return out


ENGINES = {
    "base": {},
    "weight_version": {"key_prefix": "RL-STEP8"},
    "model": {"open": {"namespace": "ERNIE-4.5-21B-A3B-Paddle"}},
    "tp_size": {"open": {"tp_size": 2}},
    "dtype": {"open": {"cache_dtype": "float16"}},
}


def test_fastdeploy_calls_pass_the_identity_kit(open_store: Callable[..., KVCoreStore]) -> None:
    report = run_identity_kit(FastDeployDriver(open_store, ENGINES))
    print(report.summary())
    assert not report.failures, report.summary()
    assert report.pairs == 1 + len(ENGINES) - 1
