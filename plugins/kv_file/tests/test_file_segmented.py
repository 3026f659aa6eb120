"""Segmented host buffers: the engine's own cache blocks, one piece per layer, read and written
in place. Same file format and checksum as a contiguous object, so either kind of caller reads
what the other wrote; cold reads of page-aligned pieces go around the page cache."""

from __future__ import annotations

import numpy as np
import pytest
from kv_file_testutil import (
    LAYOUT,
    aligned_zeros,
    direct_reads_work,
    drop_cached_pages,
    object_files,
    open_store,
    payload,
    read,
    write,
)

from kvcore import HostBuffers

#: every test here runs on both I/O paths: native (kvcore.fileio) and Python
pytestmark = pytest.mark.usefixtures("io_path")

KEYS = ["s0", "s1", "s2"]
CACHE_BLOCKS = 8  # blocks per layer tensor of the "engine"
BLOCK_IDS = (5, 0, 3)  # where KEYS[i] lives in the engine's cache


def _engine_cache() -> list[list[np.ndarray]]:
    """Per part, per layer: a page-aligned tensor [CACHE_BLOCKS, layer block bytes]."""
    return [
        [aligned_zeros(CACHE_BLOCKS, LAYOUT.layer_block_bytes(p)) for _ in range(LAYOUT.num_layers)]
        for p in LAYOUT.parts
    ]


def _segmented(cache: list[list[np.ndarray]]) -> HostBuffers:
    return HostBuffers(
        ptrs=(),
        nbytes=tuple(LAYOUT.part_bytes(p) for p in LAYOUT.parts),
        layer_ptrs=tuple(tuple(layer.ctypes.data for layer in part) for part in cache),
        block_ids=BLOCK_IDS,
        segment_nbytes=tuple(LAYOUT.layer_block_bytes(p) for p in LAYOUT.parts),
    )


def _object_bytes(cache: list[list[np.ndarray]], part: int, block_id: int) -> bytes:
    """An object's payload as the engine holds it: its layers' pieces in order."""
    return b"".join(layer[block_id].tobytes() for layer in cache[part])


def test_a_contiguous_write_reads_into_the_engines_blocks(tmp_path) -> None:
    store = open_store(str(tmp_path / "s"))
    assert write(store, KEYS) == 3
    cache = _engine_cache()
    assert store.read(store.request("r", KEYS, host=_segmented(cache))) == 3
    expected = payload(store, KEYS)
    for i, block_id in enumerate(BLOCK_IDS):
        for j in range(len(LAYOUT.parts)):
            assert _object_bytes(cache, j, block_id) == expected[j][i].tobytes()
    store.close()


def test_the_engines_blocks_write_what_a_contiguous_read_gets(tmp_path) -> None:
    store = open_store(str(tmp_path / "s"))
    cache = _engine_cache()
    rng = np.random.default_rng(7)
    for part in cache:
        for layer in part:
            layer[:] = rng.integers(0, 256, layer.shape, dtype=np.uint8)
    assert store.write(store.request("w", KEYS, host=_segmented(cache))) == 3
    done, got = read(store, KEYS)
    assert done == 3
    for i, block_id in enumerate(BLOCK_IDS):
        for j in range(len(LAYOUT.parts)):
            assert got[j][i].tobytes() == _object_bytes(cache, j, block_id)
    store.close()


def test_cold_pieces_are_read_direct_and_verified(tmp_path) -> None:
    if not direct_reads_work(str(tmp_path)):
        pytest.skip(f"{tmp_path}'s file system or kernel lacks O_DIRECT or cachestat(2)")
    root = str(tmp_path / "s")
    store = open_store(root)
    assert write(store, KEYS) == 3
    drop_cached_pages(object_files(root))
    cache = _engine_cache()
    assert store.read(store.request("r", KEYS, host=_segmented(cache))) == 3
    assert store.stats()["backend_direct_reads"] == 3 * len(LAYOUT.parts)
    expected = payload(store, KEYS)
    assert _object_bytes(cache, 1, BLOCK_IDS[2]) == expected[1][2].tobytes()
    store.close()
