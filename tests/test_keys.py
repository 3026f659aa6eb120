"""Prefix keys: chained, scoped, stable across processes and machines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcore.keys import (
    KeyScope,
    NameRows,
    ObjectName,
    block_hashes,
    name_columns,
    object_name,
    object_names,
    root_hash,
)

TOKENS = list(range(1000, 1000 + 70))


def test_one_key_per_full_block_and_chaining():
    keys = block_hashes(TOKENS, 16)
    assert len(keys) == 4  # 70 tokens: 4 full blocks, the partial one gets no key
    assert len(set(keys)) == 4
    # a key commits to every token before it: change token 0, every key changes
    other = block_hashes([999, *TOKENS[1:]], 16)
    assert all(a != b for a, b in zip(keys, other, strict=True))
    # change a token in block 2: blocks 0 and 1 keep their keys
    edited = list(TOKENS)
    edited[40] += 1
    assert block_hashes(edited, 16)[:2] == keys[:2]
    assert block_hashes(edited, 16)[2:] != keys[2:]


def test_parent_continues_the_chain():
    keys = block_hashes(TOKENS, 16)
    assert block_hashes(TOKENS[32:64], 16, parent=keys[1]) == keys[2:4]


def test_scope_is_folded_into_the_root():
    base = block_hashes(TOKENS, 16)
    for field, value in [
        ("model", "m"),
        ("namespace", "ns"),
        ("adapter", "lora-1"),
        ("weight_version", "v2"),
        ("extra", {"tenant": "a"}),
    ]:
        assert block_hashes(TOKENS, 16, KeyScope(**{field: value})) != base, field
    assert root_hash(KeyScope(extra={"a": "1", "b": "2"})) == root_hash(
        KeyScope(extra={"b": "2", "a": "1"})
    )


def test_bad_tokens_are_named():
    with pytest.raises(ValueError, match="-1"):
        block_hashes([1, -1, 3, 4], 2)
    with pytest.raises(ValueError, match="4294967296"):
        block_hashes([2**32, 1], 2)
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)


def test_object_names_include_namespace_part_rank_and_world():
    name = object_name("abc", "k_scale", namespace="ns", rank=3, world_size=8)
    assert name == "ns/abc/k_scale/r3of8"
    grid = object_names(["a", "b"], ("k", "v"), namespace="ns", rank=0, world_size=2)
    assert grid == (("ns/a/k/r0of2", "ns/a/v/r0of2"), ("ns/b/k/r0of2", "ns/b/v/r0of2"))


def test_identical_across_processes_with_different_hash_seeds():
    code = (
        "import json; from kvcore.keys import block_hashes, KeyScope; "
        f"print(json.dumps(block_hashes({TOKENS!r}, 16, KeyScope(model='m', extra={{'x': 'y'}}))))"
    )
    outs = []
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outs.append(json.loads(out.stdout))
    assert outs[0] == outs[1] == block_hashes(TOKENS, 16, KeyScope(model="m", extra={"x": "y"}))


def test_key_format_is_pinned():
    # a change to the hash format must be deliberate: it orphans every stored block
    assert block_hashes(TOKENS[:16], 16)[0] == (
        "24054ab1e8f9ef2e38280754c67d1e7fd32247a2e33d72de46eaf8c3f218e98b"
    )


def test_name_columns_of_kvcore_names_and_of_plain_rows() -> None:
    names = object_names(["a", "b", "c"], ["k", "v"], namespace="ns", rank=0, world_size=1)
    rows = tuple(tuple(row) for row in names)
    want = [[row[0] for row in rows], [row[1] for row in rows]]
    assert [list(c) for c in name_columns(names, 2)] == want
    assert [list(c) for c in name_columns(rows, 2)] == want  # built by other code
    assert [list(c) for c in name_columns(names[1:], 2)] == [w[1:] for w in want]
    assert name_columns((), 2) == [[], []]


def _typed(n: int = 5) -> NameRows:
    keys = [f"key{i}" for i in range(n)]
    return object_names(keys, ["k", "v"], namespace="ns", rank=1, world_size=2, weight_version="w3")


def test_take_keeps_the_identity_of_the_rows_it_takes() -> None:
    names = _typed()
    taken = names.take([3, 0, -1])
    assert isinstance(taken, NameRows) and taken.typed
    assert list(taken) == [names[3], names[0], names[4]]
    assert taken.identity(0, 1) == ObjectName("ns", "key3", "v", 1, 2, "w3")
    assert taken.identity(0, 1).format() == taken[0][1]  # the identity names the same object
    assert taken.blocks() == [names.blocks()[i] for i in (3, 0, 4)]
    assert taken.with_parts(["sum"]) == names.with_parts(["sum"]).take([3, 0, 4])
    assert taken.column(0) == [names[i][0] for i in (3, 0, 4)]


def test_take_and_slicing_compose() -> None:
    names = _typed(8)
    assert names[2:7].take([0, 2, 4]) == names.take([2, 4, 6])
    assert names.take([6, 5, 4, 3])[1:3] == names.take([5, 4])
    assert names[::2].take(range(4)).typed
    assert names.take([1, 3, 5])[1:].identity(1, 0) == names.identity(5, 0)


def test_take_of_nothing_and_of_plain_names() -> None:
    names = _typed()
    empty = names.take([])
    assert len(empty) == 0 and list(empty) == [] and empty.typed
    assert empty.blocks() == []
    plain = NameRows([["a", "b", "c"]], 3)  # built otherwise: no identity to keep
    assert list(plain.take([2, 0])) == [("c",), ("a",)]
    assert not plain.take([2, 0]).typed and plain.take([1]).identity(0, 0) is None
    no_parts = NameRows([], 3)  # a request of tokens only
    assert list(no_parts.take([0, 2])) == [(), ()]


@pytest.mark.parametrize("index", [5, -6, 100])
def test_take_of_a_row_that_is_not_there_raises(index: int) -> None:
    with pytest.raises(IndexError, match=f"block index {index} out of range for 5 rows"):
        _typed().take([0, index])
    with pytest.raises(IndexError):
        NameRows([], 5).take([index])
