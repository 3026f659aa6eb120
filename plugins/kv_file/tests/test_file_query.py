"""Queries of long runs: the leading run ends at the first block with any part missing,
wherever it falls in the index's strides, and a block the index has not learned (written by
another process) is looked up on disk rather than ending the run."""

from __future__ import annotations

import os

import pytest
from kv_file.backend import _QUERY_DEADLINE_STRIDE
from kv_file_testutil import object_path, open_store, query, write

import kvcore

TINY = kvcore.CacheLayout(num_layers=1, num_heads=1, block_size=2, head_dim=4, num_blocks=4)
STRIDE = _QUERY_DEADLINE_STRIDE
N = 2 * STRIDE + 300  # three strides, the last one partial


@pytest.fixture
def store_and_keys(tmp_path):
    store = open_store(str(tmp_path / "s"), TINY)
    keys = [f"q{i}" for i in range(N)]
    assert write(store, keys) == N
    yield store, keys
    store.close()


def test_a_full_run_counts_every_block(store_and_keys) -> None:
    store, keys = store_and_keys
    assert query(store, keys) == N


@pytest.mark.parametrize(
    ("gap", "part"),
    [
        (0, 0),
        (7, 1),  # only the V object is missing
        (STRIDE - 1, 0),  # the last block of the first stride
        (STRIDE, 1),  # the first block of the second
        (2 * STRIDE + 299, 0),  # the last block
    ],
)
def test_the_run_ends_at_the_first_block_with_a_part_missing(store_and_keys, gap, part) -> None:
    store, keys = store_and_keys
    # a removal through the backend drops both parts; remove one part's file by hand, as a
    # crashed writer or an operator would, and let the index learn it from a rescan
    os.unlink(object_path(store, keys[gap], part))
    store.plugin.rescan()
    assert query(store, keys) == gap
    assert query(store, keys[gap + 1 :]) == N - gap - 1  # the rest is still there


def test_a_block_the_index_has_not_learned_is_found_on_disk(tmp_path) -> None:
    root = str(tmp_path / "s")
    writer = open_store(root, TINY)
    reader = open_store(root, TINY)  # another "process": its index learned nothing yet
    keys = [f"u{i}" for i in range(N)]
    assert write(writer, keys[: STRIDE + 5]) == STRIDE + 5
    assert query(reader, keys) == STRIDE + 5
    assert write(writer, keys[STRIDE + 5 :]) == N - STRIDE - 5
    assert query(reader, keys) == N
    writer.close()
    reader.close()
