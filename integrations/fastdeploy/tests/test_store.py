"""KVCoreStore's side of FastDeploy's storage interface: names, orders, answers, errors."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
from kvcore_fastdeploy import (
    FAILED,
    NOT_FOUND,
    KVCoreStore,
    fastdeploy_names,
    layout_from_fastdeploy,
    part_of,
)

import kvcore
from kvcore.integrity import FOREIGN_SUFFIX

LAYOUT = dict(key_cache_shape=[8, 2, 4, 8], num_layers=2, cache_dtype="bfloat16")


def _objects(store: KVCoreStore) -> dict[str, bytes]:
    """The memory backend's objects (its own dict): what was stored, under which names."""
    return store.backend.plugin._objects


def _regions(store: KVCoreStore, n: int, parts: tuple[str, ...], fill: bool):
    """One numpy region per block and part; K regions first, then V, as FastDeploy orders."""
    rng = np.random.default_rng(0)
    arrays = {
        p: [
            rng.integers(0, 256, store.layout.part_bytes(p), dtype=np.uint8)
            if fill
            else np.zeros(store.layout.part_bytes(p), dtype=np.uint8)
            for _ in range(n)
        ]
        for p in parts
    }
    locations = [a.ctypes.data for p in parts for a in arrays[p]]
    sizes = [store.layout.part_bytes(p) for p in parts for _ in range(n)]
    return arrays, locations, sizes


def test_objects_are_stored_under_fastdeploys_names_unchanged(
    open_store: Callable[..., KVCoreStore],
) -> None:
    store = open_store("memory", **LAYOUT)
    names = fastdeploy_names(["9f86d0", "e3b0c4"], 0, key_prefix="RL-STEP7")
    arrays, locations, sizes = _regions(store, 2, ("k", "v"), fill=True)

    assert store.batch_set(names["k"] + names["v"], locations, sizes) == [0, 0, 0, 0]

    data = [
        "prefixRL-STEP7_9f86d0_0_key",
        "prefixRL-STEP7_e3b0c4_0_key",
        "prefixRL-STEP7_9f86d0_0_value",
        "prefixRL-STEP7_e3b0c4_0_value",
    ]
    # beside each object, its digest under the object's own name (memory keeps no checksums)
    assert sorted(_objects(store)) == sorted(data + [n + FOREIGN_SUFFIX for n in data])
    assert _objects(store)["prefixRL-STEP7_e3b0c4_0_value"] == arrays["v"][1].tobytes()


def test_batch_get_answers_bytes_read_per_key_in_fastdeploys_order(
    open_store: Callable[..., KVCoreStore],
) -> None:
    store = open_store("memory", **LAYOUT)
    names = fastdeploy_names(["a", "b", "c"], 0)
    src, locations, sizes = _regions(store, 2, ("k", "v"), fill=True)
    store.batch_set(names["k"][:2] + names["v"][:2], locations, sizes)  # blocks a, b only

    dst, locations, sizes = _regions(store, 3, ("k", "v"), fill=False)
    got = store.batch_get(names["k"] + names["v"], locations, sizes)

    kb = store.layout.part_bytes("k")
    assert got == [kb, kb, NOT_FOUND, kb, kb, NOT_FOUND]
    assert dst["k"][1].tobytes() == src["k"][1].tobytes()
    assert dst["v"][0].tobytes() == src["v"][0].tobytes()


def test_query_counts_the_leading_run_of_complete_blocks(
    open_store: Callable[..., KVCoreStore],
) -> None:
    store = open_store("memory", **{**LAYOUT, "cache_dtype": "block_wise_fp8"})
    names = fastdeploy_names(["a", "b", "c"], 1, scales=True)
    parts = ("k", "v", "k_scale", "v_scale")
    _, locations, sizes = _regions(store, 3, parts, fill=True)
    keys = [k for p in parts for k in names[p]]
    assert store.batch_set(keys, locations, sizes) == [0] * 12
    del _objects(store)[names["v_scale"][1]]  # block b loses a scale

    assert store.query(names["k"], names["v"], names["k_scale"], names["v_scale"], 2.0) == 1
    assert store.query(names["k"], names["v"]) == 3, "without scale keys only K and V count"
    assert store.query([], []) == 0


def test_exists_delete_and_single_object_calls(open_store: Callable[..., KVCoreStore]) -> None:
    store = open_store("memory", **LAYOUT)
    kb = store.layout.part_bytes("k")
    src = np.arange(kb, dtype=np.uint8)
    dst = np.zeros(kb, dtype=np.uint8)
    assert store.set("prefix_h_0_value", src.ctypes.data, kb) == 0
    assert store.exists(["prefix_h_0_key", "prefix_h_0_value", "x"]) == {
        "prefix_h_0_key": False,
        "prefix_h_0_value": True,
        "x": False,
    }
    assert store.get("prefix_h_0_value", dst.ctypes.data, kb) == kb
    assert (dst == src).all()
    assert store.get("prefix_h_0_key", dst.ctypes.data, kb) == NOT_FOUND
    assert store.delete("prefix_h_0_value") is True
    assert store.exists(["prefix_h_0_value"]) == {"prefix_h_0_value": False}


def test_clear_drops_the_namespace(open_store: Callable[..., KVCoreStore]) -> None:
    """kv_file keeps a namespace per directory: FastDeploy's model id scopes the clear."""
    store = open_store("file", **LAYOUT)
    other = open_store("file", namespace="another-model", **LAYOUT)
    names = fastdeploy_names(["a"], 0)
    for s in (store, other):
        _, locations, sizes = _regions(s, 1, ("k", "v"), fill=True)
        assert s.batch_set(names["k"] + names["v"], locations, sizes) == [0, 0]

    if not store.backend.implements("kvcore_clear"):
        # the adapter says so instead of pretending: FastDeploy logs a failed clear
        assert store.clear() is False
        assert store.query(names["k"], names["v"]) == 1
        return
    assert store.clear() is True
    assert store.query(names["k"], names["v"]) == 0
    assert other.query(names["k"], names["v"]) == 1


def test_batch_set_writes_only_what_the_store_admits(
    open_store: Callable[..., KVCoreStore],
) -> None:
    """kv_file's admission policy decides what FastDeploy's stores write: with ``second-hit``
    a block is written the second time it is offered. A refused block is answered 0 (not a
    failure: FastDeploy has nothing to retry) and counted."""
    store = open_store("file", **LAYOUT, config={"admission": "second-hit"})
    names = fastdeploy_names(["a", "b", "c"], 0)
    src, locations, sizes = _regions(store, 2, ("k", "v"), fill=True)
    keys = names["k"][:2] + names["v"][:2]

    assert store.batch_set(keys, locations, sizes) == [0, 0, 0, 0]
    assert store.query(names["k"][:2], names["v"][:2]) == 0, "first offer: nothing written"
    assert store.stats()["blocks_refused.admit"] == store.stats()["blocks_refused"] == 2

    assert store.batch_set(keys, locations, sizes) == [0, 0, 0, 0]
    assert store.query(names["k"][:2], names["v"][:2]) == 2, "second offer: both written"
    dst, out_locations, _ = _regions(store, 2, ("k", "v"), fill=False)
    kb = store.layout.part_bytes("k")
    assert store.batch_get(keys, out_locations, sizes) == [kb] * 4
    assert dst["v"][1].tobytes() == src["v"][1].tobytes()

    # stored blocks are admitted as they are; a new block behind them is refused alone
    _, locations, sizes = _regions(store, 3, ("k", "v"), fill=True)
    assert store.batch_set(names["k"] + names["v"], locations, sizes) == [0] * 6
    assert store.query(names["k"], names["v"]) == 2
    assert store.set(names["k"][2], locations[2], sizes[2]) == 0  # c's second offer
    assert store.exists([names["k"][2]]) == {names["k"][2]: True}
    assert store.stats()["blocks_refused.admit"] == store.stats()["blocks_refused"] == 3


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda s: s.batch_get(["a_key", "a_value"], [1], [1, 1]), "target_locations"),
        (lambda s: s.batch_set(["a_key", "a_value", "b_key"], [1, 2, 3], [1, 1, 1]), "keys"),
        (lambda s: s.batch_get(["a_key", "a_value"], [1, 2], [5, 5]), "target_sizes"),
        (lambda s: s.query(["a_key"], ["a_value", "b_value"]), "v_keys"),
        (lambda s: s.query(["a_key"], ["a_value"], ["a_key_scale"]), "v_scale_keys"),
        (lambda s: s.get("a_key", 1, 3), "target_size"),
    ],
)
def test_malformed_calls_name_the_argument(
    open_store: Callable[..., KVCoreStore], call: Callable, named: str
) -> None:
    store = open_store("memory", **LAYOUT)
    with pytest.raises(ValueError, match=named):
        call(store)


class _BrokenDisk:
    """A backend whose reads and writes fail (a disk gone bad): failures, not absences."""

    config_model = kvcore.BackendConfig
    capabilities = kvcore.Capabilities(addressing="key", io="host")

    def __init__(self, config: kvcore.BackendConfig, context: kvcore.BackendContext) -> None:
        pass

    @kvcore.hookimpl
    def kvcore_query(self, request: kvcore.BlockRequest) -> int:
        return request.num_blocks

    @kvcore.hookimpl
    def kvcore_read(self, request: kvcore.BlockRequest) -> int:
        raise OSError("I/O error reading the store")

    @kvcore.hookimpl
    def kvcore_write(self, request: kvcore.BlockRequest) -> int:
        return kvcore.Outcome(0, "disk full")


def test_a_failing_backend_answers_failed_never_raises() -> None:
    layout = layout_from_fastdeploy(**LAYOUT)
    backend = kvcore.open_backend(_BrokenDisk, context={"layout": layout})
    store = KVCoreStore(backend)
    names = fastdeploy_names(["a", "b"], 0)
    _, locations, sizes = _regions(store, 2, ("k", "v"), fill=False)
    keys = names["k"] + names["v"]
    assert store.batch_get(keys, locations, sizes) == [FAILED] * 4
    assert store.batch_set(keys, locations, sizes) == [FAILED] * 4
    stats = store.stats()
    # the digests kvcore keeps beside blocks (this store has no checksums) are read and
    # written first, so the store's failures are met there
    assert (stats["errors.read_digests"], stats["failures_reported.write_digests"]) == (1, 1)
    backend.close()


def test_a_token_addressed_backend_is_refused() -> None:
    class Tokens(_BrokenDisk):
        capabilities = kvcore.Capabilities(addressing="token", io="device")

    backend = kvcore.open_backend(Tokens, context={"layout": layout_from_fastdeploy(**LAYOUT)})
    with pytest.raises(ValueError, match="key-addressed"):
        KVCoreStore(backend)
    backend.close()


def test_open_refuses_what_fastdeploy_cannot_use(open_store: Callable[..., KVCoreStore]) -> None:
    with pytest.raises(ValueError, match="attention_store"):
        open_store("attentionstore", **LAYOUT)
    with pytest.raises(kvcore.UnknownBackendError):
        open_store("no-such-backend", **LAYOUT)
    with pytest.raises(ValueError, match="kvcache_storage_backend"):
        KVCoreStore.open("mooncake", namespace="m", tp_rank=0, tp_size=1, device_id=0, **LAYOUT)
    with pytest.raises(ValueError, match="scale_item_bytes"):
        open_store("memory", scale_item_bytes=3, **LAYOUT)


def test_scale_sizes_follow_fastdeploys_scale_item_bytes(
    open_store: Callable[..., KVCoreStore],
) -> None:
    fp8 = {**LAYOUT, "cache_dtype": "block_wise_fp8"}
    assert open_store("memory", scale_item_bytes=4, **fp8).layout.scale_dtype == "float32"
    assert open_store("memory", scale_item_bytes=2, **fp8).layout.scale_dtype == "bfloat16"


def test_layout_is_fastdeploys_staging_stride() -> None:
    """part_bytes == FastDeploy's cache_buffer_stride_bytes / scale_buffer_stride_bytes."""
    layout = layout_from_fastdeploy(
        [100, 8, 64, 128], 28, "block_wise_fp8", num_extra_layers=1, scale_dtype="bfloat16"
    )
    layers = 28 + 1
    assert layout.part_bytes("k") == layers * 8 * 64 * 128 * 1
    assert layout.part_bytes("k_scale") == layers * 8 * 64 * 2
    with pytest.raises(ValueError, match="key_cache_shape"):
        layout_from_fastdeploy([100, 8, 64], 28, "bfloat16")
    with pytest.raises(ValueError, match="cache_dtype"):
        layout_from_fastdeploy([100, 8, 64, 128], 28, "int4")


@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("prefix_h_0_key", "k"),
        ("prefix_h_0_value", "v"),
        ("prefix_h_0_key_scale", "k_scale"),
        ("prefixRL-STEP1_h_3_value_scale", "v_scale"),
    ],
)
def test_part_of_reads_fastdeploys_suffixes(name: str, part: str) -> None:
    assert part_of(name) == part


def test_a_master_not_up_at_start_is_a_miss_until_it_opens() -> None:
    """FastDeploy's cache transfer manager opens its store while the Mooncake master is not up
    yet: opening works, every call is a miss or FAILED, and once the master is up the backend
    opens on the next try, with FastDeploy's registered region, and stores and reads."""
    from kv_mooncake.testing import MooncakeCluster, free_port

    cluster = MooncakeCluster(storage_bytes=64 << 20)
    cluster.master.rpc_port, cluster.master.metrics_port = free_port(), free_port()
    config = cluster.config(connect_timeout_s=1.0)  # where no master listens yet
    store = KVCoreStore.open(
        "kvcore:mooncake",
        namespace="m",
        tp_rank=0,
        tp_size=1,
        device_id=0,
        config=config,
        environ={"KVCORE_FASTDEPLOY_REOPEN_INTERVAL_S": "0.5"},
        **LAYOUT,
    )
    try:
        names = fastdeploy_names(["a", "b"], 0)
        keys = names["k"] + names["v"]
        arrays, locations, sizes = _regions(store, 2, ("k", "v"), fill=True)
        staging = np.zeros(1 << 20, dtype=np.uint8)
        store.register_buffer(staging.ctypes.data, staging.nbytes)  # before it opens
        assert store.batch_set(keys, locations, sizes) == [FAILED] * 4
        assert store.query(names["k"], names["v"]) == 0
        assert store.exists(keys) == dict.fromkeys(keys, False)
        stats = store.stats()
        assert stats["host.unavailable.write"] == 1 and stats["open_failures"] >= 1

        cluster.start()
        time.sleep(0.6)  # past the reopen interval: the next call opens it
        assert store.batch_set(keys, locations, sizes) == [0] * 4
        assert store.query(names["k"], names["v"]) == 2
        read, into, _ = _regions(store, 2, ("k", "v"), fill=False)
        assert store.batch_get(keys, into, sizes) == sizes
        assert [a.tobytes() for a in read["k"] + read["v"]] == [
            a.tobytes() for a in arrays["k"] + arrays["v"]
        ]
        assert store.stats()["backend_registered_regions"] == 1  # the region it was given
    finally:
        store.close()
        cluster.close()


def test_every_block_is_the_engines_tenant_where_tenants_are_set(
    open_store: Callable[..., KVCoreStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    # FastDeploy's calls carry no request: one tenant per engine, the settings' default one
    monkeypatch.setenv("KVCORE_FASTDEPLOY_TENANTS", '{"default_tenant": "team-x"}')
    store = open_store("memory", **LAYOUT)
    names = fastdeploy_names(["a", "b"], 0)
    _, locations, sizes = _regions(store, 2, ("k", "v"), fill=True)
    assert store.batch_set(names["k"] + names["v"], locations, sizes) == [0] * 4
    assert store.query(names["k"], names["v"]) == 2
    stats = store.backend.stats()
    assert stats["tenant_blocks_done.query.team-x"] == 2
    assert any(k.startswith("tenant_blocks_done.write.team-x") for k in stats)
    monkeypatch.setenv("KVCORE_FASTDEPLOY_TENANTS", '{"default_tenant": "team/x"}')
    with pytest.raises(ValueError, match=r"KVCORE_FASTDEPLOY_TENANTS: .*'team/x' is not a tenant"):
        open_store("memory", **LAYOUT)
