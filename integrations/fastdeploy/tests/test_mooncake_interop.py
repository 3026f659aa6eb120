"""Blocks written by FastDeploy's own MooncakeStore are readable through kvcore, and back.

FastDeploy's MooncakeStore (``mooncake_store.py`` at
PaddlePaddle/FastDeploy@ecce94cdc0dd2694826db98dcfb041aee8c5e499) is a thin layer over the raw
Mooncake client: ``setup(...)`` with keyword arguments, ``register_buffer`` for the staging
buffers, ``batch_is_exist`` for ``query``/``exists``, ``batch_put_from`` / ``batch_get_into``
for ``batch_set`` / ``batch_get``. ``FastDeployMooncake`` below makes exactly those client
calls (FastDeploy itself cannot be installed here), so "the FastDeploy way" is the real client
on a real ``mooncake_master`` (127.0.0.1), with FastDeploy's names and staging layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from conftest import point_at_cluster
from fd_flows import FastDeployRank
from kv_mooncake.testing import MooncakeCluster
from kvcore_fastdeploy import KVCoreStore
from kvcore_fastdeploy.settings import VERIFY_BLOCKS_ENV

import kvcore


class FastDeployMooncake:
    """The client calls FastDeploy's MooncakeStore makes, one for one."""

    def __init__(self, master_address: str) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.client = MooncakeDistributedStore()
        # MooncakeStore.__init__: setup() with keyword arguments; it contributes memory itself
        code = self.client.setup(
            local_hostname="127.0.0.1",
            metadata_server="P2PHANDSHAKE",
            global_segment_size=64 << 20,
            local_buffer_size=16 << 20,
            protocol="tcp",
            rdma_devices="",
            master_server_addr=master_address,
        )
        assert code == 0, f"raw Mooncake client setup failed: {code}"

    def register_buffer(self, ptr: int, size: int) -> None:
        assert self.client.register_buffer(ptr, size) == 0

    def exists(self, keys: Sequence[str]) -> dict[str, int]:
        return dict(zip(keys, self.client.batch_is_exist(list(keys)), strict=True))

    def query(self, k_keys, v_keys, k_scale_keys=None, v_scale_keys=None, timeout=1.0) -> int:
        # MooncakeStore.query: one existence check, then the leading run of complete blocks
        runs = [k_keys, v_keys] + ([k_scale_keys, v_scale_keys] if k_scale_keys else [])
        found = self.exists([k for run in runs for k in run])
        n = 0
        for block in zip(*runs, strict=True):
            if not all(found[k] == 1 for k in block):
                break
            n += 1
        return n

    def batch_set(self, keys, target_locations, target_sizes) -> list[int]:
        return list(self.client.batch_put_from(keys, target_locations, target_sizes))

    def batch_get(self, keys, target_locations, target_sizes) -> list[int]:
        return list(self.client.batch_get_into(keys, target_locations, target_sizes))

    def close(self) -> None:
        self.client.close()


@pytest.fixture(scope="module")
def fastdeploy_side(mooncake_cluster: MooncakeCluster) -> Iterator[FastDeployMooncake]:
    # its segment holds what it writes, so it stays up until the module's reads are done (each
    # test names its own blocks); one client for all saves its 2-3 s close per test
    side = FastDeployMooncake(mooncake_cluster.master.address)
    yield side
    side.close()


@pytest.fixture
def kvcore_side(
    open_store: Callable[..., KVCoreStore],
    mooncake_cluster: MooncakeCluster,
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[..., KVCoreStore]:
    point_at_cluster(monkeypatch, mooncake_cluster)

    def open_(verify: str = "never", **kw: Any) -> KVCoreStore:
        # FastDeploy's own MooncakeStore writes no digests: a fleet where it writes beside
        # kvcore reads objects as they are (see test_an_object_without_a_digest_is_refused)
        monkeypatch.setenv(VERIFY_BLOCKS_ENV, verify)
        return open_store("mooncake", **kw)

    return open_


def _hashes(n: int, salt: str) -> list[str]:
    tokens = list(range(n * 16))
    return kvcore.block_hashes(tokens, 16, kvcore.KeyScope(model=f"interop-{salt}"))


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "block_wise_fp8"])
def test_blocks_fastdeploy_wrote_are_read_through_kvcore(
    fastdeploy_side: FastDeployMooncake,
    kvcore_side: Callable[..., KVCoreStore],
    cache_dtype: str,
) -> None:
    store = kvcore_side(cache_dtype=cache_dtype)
    layout = store.layout
    fd_rank = FastDeployRank(fastdeploy_side, layout, key_prefix="RL-STEP5")
    hashes = _hashes(4, f"fd-to-kvcore-{cache_dtype}")
    fd_rank.fill([2, 4, 6, 8], seed=11)
    wrote = fd_rank.write_back(hashes, [2, 4, 6, 8])
    assert set(wrote.answers) == {0}, "the raw client stored every object"

    kv_rank = FastDeployRank(store, layout, key_prefix="RL-STEP5")
    got = kv_rank.read(hashes, [0, 1, 3, 5])

    assert (got.matched, got.restored) == (4, [0, 1, 3, 5])
    for src, dst in zip([2, 4, 6, 8], [0, 1, 3, 5], strict=True):
        assert kv_rank.block_bytes(dst) == fd_rank.block_bytes(src)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "block_wise_fp8"])
def test_blocks_kvcore_wrote_are_read_the_fastdeploy_way(
    fastdeploy_side: FastDeployMooncake,
    kvcore_side: Callable[..., KVCoreStore],
    cache_dtype: str,
) -> None:
    store = kvcore_side(cache_dtype=cache_dtype)
    layout = store.layout
    kv_rank = FastDeployRank(store, layout)
    hashes = _hashes(3, f"kvcore-to-fd-{cache_dtype}")
    kv_rank.fill([7, 8, 9], seed=12)
    assert kv_rank.write_back(hashes, [7, 8, 9]).written == [7, 8, 9]

    # the raw client finds every object under FastDeploy's own name: kvcore changed none
    names = kv_rank.names(hashes)
    assert set(fastdeploy_side.exists([n for run in names.values() for n in run]).values()) == {1}
    fd_rank = FastDeployRank(fastdeploy_side, layout)
    got = fd_rank.read(hashes, [0, 1, 2])

    assert (got.matched, got.restored) == (3, [0, 1, 2])
    for src, dst in zip([7, 8, 9], [0, 1, 2], strict=True):
        assert fd_rank.block_bytes(dst) == kv_rank.block_bytes(src)


def test_a_prefix_written_by_each_side_is_read_whole(
    fastdeploy_side: FastDeployMooncake, kvcore_side: Callable[..., KVCoreStore]
) -> None:
    """FastDeploy stores blocks 0-1, kvcore's write-back then skips them and adds 2-3."""
    store = kvcore_side()
    hashes = _hashes(4, "mixed")
    fd_rank = FastDeployRank(fastdeploy_side, store.layout)
    fd_rank.fill([0, 1, 2, 3], seed=13)
    fd_rank.write_back(hashes[:2], [0, 1])

    kv_rank = FastDeployRank(store, store.layout)
    kv_rank.fill([0, 1, 2, 3], seed=13)  # the same KV, computed again by this pod
    again = kv_rank.write_back(hashes, [0, 1, 2, 3])
    assert (again.matched, again.written) == (2, [2, 3])

    reader = FastDeployRank(fastdeploy_side, store.layout)
    assert reader.read(hashes, [4, 5, 6, 7]).restored == [4, 5, 6, 7]
    assert [reader.block_bytes(b) for b in (4, 5, 6, 7)] == [
        fd_rank.block_bytes(b) for b in (0, 1, 2, 3)
    ]


def test_an_object_without_a_digest_is_refused_by_default(
    fastdeploy_side: FastDeployMooncake, kvcore_side: Callable[..., KVCoreStore]
) -> None:
    """Mooncake keeps no checksums, so by default kvcore keeps a digest beside every object
    (kvcore.integrity): an object FastDeploy's own store wrote has none and is a counted miss,
    never bytes that cannot be checked."""
    store = kvcore_side(verify="auto")
    layout = store.layout
    hashes = _hashes(2, "unverified")
    fd_rank = FastDeployRank(fastdeploy_side, layout)
    fd_rank.fill([0, 1], seed=14)
    fd_rank.write_back(hashes, [0, 1])
    got = FastDeployRank(store, layout).read(hashes, [2, 3])
    assert got.matched == 0
    assert store.backend.verifies_blocks
