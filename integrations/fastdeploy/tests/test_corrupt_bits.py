"""A bit flipped in a stored object never reaches FastDeploy's cache (issue 37).

FastDeploy's calls name objects with FastDeploy's own names; a backend that keeps no checksums
(memory, a real Mooncake on 127.0.0.1) keeps a digest beside each of them (kvcore.integrity),
so the flip is a counted miss in both of FastDeploy's read paths: ``batch_get`` in its flow,
and a single ``get``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from fd_flows import FastDeployRank
from kvcore_fastdeploy import KVCoreStore

import kvcore
from kvcore.testing.corruption import corrupt_reads, flip_a_stored_bit


def _hashes(n: int, salt: str) -> list[str]:
    return kvcore.block_hashes(list(range(n * 16)), 16, kvcore.KeyScope(model=f"flip-{salt}"))


@pytest.mark.parametrize("backend", ["memory", "mooncake"])
def test_a_flipped_bit_is_never_restored(
    open_store: Callable[..., KVCoreStore], backend: str
) -> None:
    store = open_store(backend)
    layout = store.layout
    writer = FastDeployRank(store, layout)
    hashes = _hashes(3, f"flow-{backend}")
    writer.fill([0, 1, 2], seed=21)
    assert writer.write_back(hashes, [0, 1, 2]).written == [0, 1, 2]
    names = writer.names(hashes)
    flip_a_stored_bit(store.backend, names["v"][1], layout.part_bytes("v"))

    reader = FastDeployRank(store, layout)
    got = reader.read(hashes, [4, 5, 6])
    assert got.restored == [4], got
    assert reader.block_bytes(4) == writer.block_bytes(0)
    assert corrupt_reads(store.backend) == 1
    # the corrupt block is gone (data and digest): a miss from now on, and written again
    assert store.query(names["k"], names["v"]) == 1
    assert writer.write_back(hashes, [0, 1, 2]).written == [1, 2]
    assert FastDeployRank(store, layout).read(hashes, [4, 5, 6]).restored == [4, 5, 6]


@pytest.mark.parametrize("backend", ["memory", "mooncake"])
def test_a_single_get_of_a_flipped_object_answers_a_failure(
    open_store: Callable[..., KVCoreStore], backend: str
) -> None:
    store = open_store(backend)
    layout = store.layout
    writer = FastDeployRank(store, layout)
    hashes = _hashes(1, f"get-{backend}")
    writer.fill([0], seed=22)
    writer.write_back(hashes, [0])
    key = writer.names(hashes)["k"][0]
    size = layout.part_bytes("k")
    flip_a_stored_bit(store.backend, key, size)

    out = np.zeros(size, dtype=np.uint8)
    assert store.get(key, out.ctypes.data, size) < 0
    assert corrupt_reads(store.backend) == 1
