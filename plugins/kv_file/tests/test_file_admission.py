"""kv_file's admission: the configured policy answers kvcore_admit, learns from reads, reports
itself in stats and Prometheus; a write stores what it is given either way."""

from __future__ import annotations

import numpy as np
import pytest
from kv_file.objfile import header_size
from kv_file_testutil import LAYOUT, open_store, query, read_verified, with_own_files, write

import kvcore
from kvcore.transfer import DeviceCache, TransferManager

KEY_LEN = len("default/kNN/k/r0of1")
BLOCK = 2 * (header_size(KEY_LEN) + LAYOUT.part_bytes("k"))


def admit(backend: kvcore.Backend, keys: list[str]) -> int:
    return int(backend.admit(backend.request("t-admit", keys)))


def test_second_hit_admits_the_second_offer(tmp_path) -> None:
    store = open_store(str(tmp_path / "s"), admission="second-hit", capacity_bytes=40 * BLOCK)
    try:
        keys = [f"k{i:02d}" for i in range(4)]
        assert admit(store, keys) == 0  # four first offers
        assert admit(store, keys) == 4
        assert admit(store, ["k10", *keys]) == 0  # k10's first offer ends the run
        assert write(store, keys[:2]) == 2  # a write stores what it is given
        assert admit(store, keys[:2]) == 2  # stored: admitted without an offer
        stats = store.stats()
        assert stats["backend_admission_policy_second_hit"] == 1
        assert stats["backend_admission_offered"] == 4 + 4 + 5
        assert stats["backend_admission_admitted"] == 4
        assert stats["backend_admission_state_entries"] <= 2 * 40
    finally:
        store.close()


def test_admitting_all_hashes_no_key_on_writes_or_reads(tmp_path, monkeypatch) -> None:
    """``admission: all`` decides by count: the policy ids (a hash of each key) are not
    computed on the write or the read path."""
    import kv_file.admission

    hashed: list[str] = []
    real = kv_file.admission.block_id
    monkeypatch.setattr(kv_file.admission, "block_id", lambda k: hashed.append(k) or real(k))
    store = open_store(str(tmp_path / "s"), admission="all", capacity_bytes=40 * BLOCK)
    try:
        keys = [f"k{i:02d}" for i in range(6)]
        assert admit(store, keys) == 6
        assert write(store, keys) == 6
        assert read_verified(store, keys) == 6
        assert admit(store, keys) == 6  # stored already
        assert hashed == []
    finally:
        store.close()
    # the adaptive policy does use them (the same calls hash every key)
    store = open_store(str(tmp_path / "a"), admission="adaptive", capacity_bytes=40 * BLOCK)
    try:
        assert admit(store, keys) == 6 and write(store, keys) == 6
        assert read_verified(store, keys) == 6
        assert len(hashed) >= 12
    finally:
        store.close()


def test_adaptive_is_the_default_and_admits_everything_while_there_is_room(tmp_path) -> None:
    store = open_store(str(tmp_path / "s"), capacity_bytes=40 * BLOCK)
    try:
        assert store.config.admission == "adaptive"
        keys = [f"k{i:02d}" for i in range(8)]
        assert admit(store, keys) == 8
        assert write(store, keys) == 8
        assert read_verified(store, keys) == 8
        stats = store.stats()
        assert stats["backend_admission_policy_adaptive"] == 1
        # sized from the layout: the capacity between the watermarks, in blocks, less what the
        # store's own files (journal, ledger) count against it
        capacity, own = int(stats["backend_capacity_bytes"]), stats["backend_own_files_bytes"]
        between = (int(capacity * 0.95) + int(capacity * 0.85)) // 2 - own
        assert stats["backend_admission_capacity_blocks"] == between // BLOCK
        assert 33 <= between // BLOCK <= int(40 * 0.9)
        assert stats["backend_admission_following_second_hit"] == 0
    finally:
        store.close()


def test_a_full_adaptive_store_refuses_one_off_blocks_once_second_hit_leads(tmp_path) -> None:
    # 8 blocks; two hot blocks read between scans of fresh blocks: the simulations (every id
    # sampled) see second-hit keep the hot pair while all churns, so the store follows it and
    # refuses the scans' first offers
    root = str(tmp_path / "s")
    store = open_store(
        root,
        capacity_bytes=with_own_files(root, 8 * BLOCK),
        high_watermark=1.0,
        low_watermark=1.0,
        admission_sample_rate=1.0,
    )
    try:
        hot = ["hot0", "hot1"]
        fresh = iter(f"scan{i:04d}" for i in range(10_000))
        for _ in range(60):
            if query(store, hot) < 2:
                if n := admit(store, hot):
                    write(store, hot[:n])
            else:
                read_verified(store, hot)
            scan = [next(fresh) for _ in range(10)]  # more than the store holds
            if n := admit(store, scan):
                write(store, scan[:n])
        stats = store.stats()
        assert stats["backend_admission_following_second_hit"] == 1
        assert stats["backend_admission_refused"] > 300
        assert query(store, hot) == 2, "the hot blocks were pushed out by one-off scans"
    finally:
        store.close()


def test_the_policy_is_in_prometheus_through_the_manager(tmp_path) -> None:
    layout = kvcore.CacheLayout(
        num_layers=2, num_heads=1, block_size=4, head_dim=8, dtype="float32", num_blocks=4
    )
    caches = [[np.zeros(layout.kv_shape, np.float32) for _ in range(layout.num_layers)]] * 2
    tm = TransferManager(
        {"layout": layout, "max_model_len": 4 * layout.block_size},
        DeviceCache(layout, *caches),
        "file",
        {"root": str(tmp_path / "s"), "admission": "second-hit", "rescan_interval_s": 0},
    )
    try:
        result = tm.write_back(
            {"task_id": "w", "keys": ["a", "b"], "device_block_ids": [0, 1]}
        ).result()
        assert (result.num_blocks, result.refused_blocks) == (0, 2)
        text = tm.prometheus()
        assert "backend_admission_refused" in text and "admission_policy_second_hit" in text
        assert "blocks_refused" in text
    finally:
        tm.close()


def test_an_unknown_policy_is_refused_naming_the_setting(tmp_path) -> None:
    with pytest.raises(kvcore.ConfigError, match="admission"):
        open_store(str(tmp_path / "s"), admission="lfu")
    with pytest.raises(kvcore.ConfigError, match="admission_sample_rate"):
        open_store(str(tmp_path / "s"), admission_sample_rate=0)


def test_a_layout_less_store_sizes_its_policy_from_the_parts_a_request_names(tmp_path) -> None:
    """An engine whose objects are its own (LMCache's, vLLM's tier chunks) opens kv_file with
    no layout and names its parts' sizes in each request: second-hit's doorkeeper is sized
    from those before anything is stored (sized for one block, it forgot all but the last two
    offers, and a first write of three blocks was refused at every offer)."""
    store = kvcore.open_backend(
        "file",
        {"root": str(tmp_path / "s"), "admission": "second-hit", "capacity_bytes": 1 << 20},
        context={"layout": None},
    )
    try:
        keys = [f"c{i}" for i in range(8)]

        def offer() -> int:
            request = store.request("t", keys, parts=("obj",), part_bytes=(2048,))
            return int(store.admit(request))

        assert offer() == 0
        assert offer() == len(keys)
        # about (high + low) / 2 of 1 MiB over a block of 2 KiB and a header
        assert store.stats()["backend_admission_capacity_blocks"] > 100
    finally:
        store.close()
