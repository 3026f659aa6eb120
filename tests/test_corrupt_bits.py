"""A bit flipped in a stored object never reaches an engine, whoever reads it (issue 37).

Verification is the opened backend's (kvcore.integrity), so every caller gets it: here the
transfer manager and a kv_tiered stack, each over the ``memory`` backend and a real Mooncake
store on 127.0.0.1; the engine adapters run the same flip in their own test suites
(integrations/*/tests/test_corrupt_bits.py), with the same kit helper.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_correctness import cache_of, keys, lay, part_bytes

import kvcore
from kvcore.testing.corruption import corrupt_reads, flip_a_stored_bit
from kvcore.transfer import TransferManager

STORES = ["memory", "mooncake"]


def _store(name: str, request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    if name == "mooncake":
        pytest.importorskip("kv_mooncake")
        return "mooncake", request.getfixturevalue("mooncake_config")
    return "memory", {}


@pytest.mark.parametrize("storage_io", ["staged", "host_resident"])
@pytest.mark.parametrize("store", STORES)
def test_through_the_transfer_manager(store, storage_io, request):
    layout = lay()
    name, config = _store(store, request)
    backend = kvcore.open_backend(name, config, context={"layout": layout, "namespace": "flip"})
    src = cache_of(layout, np.uint16, seed=7)
    ks = keys(3, seed=7)
    with TransferManager(
        {"layout": layout, "max_model_len": 64, "storage_io": storage_io, "namespace": "flip"},
        src,
        backend,
    ) as tm:
        assert (
            tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": [0, 1, 2]}).result().ok
        )
        names = backend.request("names", ks).object_names
        flip_a_stored_bit(backend, names[1][0], layout.part_bytes("k"))
        dst = cache_of(layout, np.uint16, fill=False)
        tm.restore_caches(dst)
        r = tm.read({"task_id": "r", "keys": ks, "device_block_ids": [4, 5, 6]}).result()
        assert (r.num_blocks, r.block_ids, r.outcome) == (1, [4], "corrupt"), r
        assert part_bytes(dst, 4) == part_bytes(src, 0)
        assert corrupt_reads(backend) == 1
        # the corrupt block was removed: it is a miss now, not a wrong block
        assert tm.query({"task_id": "q", "keys": ks}) == 1
    backend.close()


@pytest.mark.parametrize("store", STORES)
def test_through_a_tier_stack(store, request, tmp_path):
    """The block is read from the lower tier (gone from the first): the corrupt copy there is
    refused, counted by that tier, and the stack's read stops before it."""
    layout = lay()
    name, config = _store(store, request)
    stack = kvcore.open_backend(
        "tiered",
        {
            "tiers": [
                {"backend": "file", "config": {"root": str(tmp_path / "t0")}},
                {"backend": name, "config": config},
            ],
            "promote": False,
        },
        context={"layout": layout, "namespace": "flip-stack"},
    )
    src = cache_of(layout, np.uint16, seed=8)
    dst = cache_of(layout, np.uint16, fill=False)
    ks = keys(3, seed=8)
    with TransferManager(
        {"layout": layout, "max_model_len": 64, "namespace": "flip-stack"}, src, stack
    ) as tm:
        assert (
            tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": [0, 1, 2]}).result().ok
        )
        assert stack.plugin.flush()  # the copies below have landed
        first, lower = stack.plugin.tiers[0], stack.plugin.tiers[1]
        names = lower.request("names", ks)
        assert lower.query(names) == 3
        assert first.remove(first.request("gone", ks)) == 3
        flip_a_stored_bit(lower, names.object_names[1][1], layout.part_bytes("v"))
        tm.restore_caches(dst)
        r = tm.read({"task_id": "r", "keys": ks, "device_block_ids": [4, 5, 6]}).result()
        assert (r.num_blocks, r.block_ids) == (1, [4]), r
        assert part_bytes(dst, 4) == part_bytes(src, 0)
        assert corrupt_reads(lower) == 1
        assert stack.query(stack.request("q", ks)) == 1
    stack.close()
