"""Prefix keys: chained, scoped, stable across processes and machines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcore.keys import KeyScope, block_hashes, name_columns, object_name, object_names, root_hash

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
