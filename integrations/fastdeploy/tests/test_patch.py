"""The FastDeploy patch: well-formed, against a named commit, and its code works with the adapter.

FastDeploy cannot be installed here, so the patch's added code is run on its own: the argument
check it adds to ``parse_args``, and the ``KVCoreStore.open(...)`` call it adds to
``_init_storage``, evaluated with the transfer manager's attribute names (those it has at the
base commit) holding a real cache description.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import textwrap
import types
from pathlib import Path

import pytest
from kvcore_fastdeploy import KVCoreStore

PATCH = Path(__file__).parents[1] / "patches" / "cache_transfer_manager-1af00818.patch"
TARGET = "fastdeploy/cache_manager/cache_transfer_manager.py"
BASE_COMMIT = "1af00818db85f4e844327e9ba5ccfacff1afe9bf"
HUNK = re.compile(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@")


def _hunks() -> list[list[str]]:
    hunks: list[list[str]] = []
    for line in PATCH.read_text().splitlines():
        if line.startswith("@@"):
            hunks.append([line])
        elif hunks:
            hunks[-1].append(line)
    return hunks


def _added(hunk: list[str]) -> str:
    return "\n".join(line[1:] for line in hunk[1:] if line.startswith("+"))


def test_the_patch_names_its_base_and_target() -> None:
    text = PATCH.read_text()
    assert f"PaddlePaddle/FastDeploy commit {BASE_COMMIT}" in text
    assert f"--- a/{TARGET}\n+++ b/{TARGET}\n" in text
    assert text.count("diff --git ") == 1, "cache_transfer_manager.py is the only file changed"


def test_every_hunk_is_consistent() -> None:
    """Line counts match each header, so git apply reads the hunks as written."""
    hunks = _hunks()
    assert len(hunks) == 8
    for hunk in hunks:
        _, old_len, _, new_len = map(int, HUNK.match(hunk[0]).groups())
        body = hunk[1:]
        assert sum(1 for line in body if line[:1] in (" ", "-")) == old_len, hunk[0]
        assert sum(1 for line in body if line[:1] in (" ", "+")) == new_len, hunk[0]


def test_the_argument_check_takes_kvcore_backends_and_keeps_the_rest() -> None:
    namespace: dict = {"argparse": argparse}
    exec(_added(_hunks()[0]), namespace)
    check = namespace["_storage_backend_arg"]
    for value in ("mooncake", "attention_store", "file", "kvcore:file", "kvcore:mooncake"):
        assert check(value) == value
    for value in ("none", "redis", "kvcore"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(value)):
            check(value)


def _open_call() -> ast.Call:
    """The ``KVCoreStore.open(...)`` call the patch adds, as an expression."""
    hunk = next(h for h in _hunks() if "KVCoreStore.open(" in _added(h))
    # the added branch without its `elif` line is a block of statements of its own
    body = [line for line in _added(hunk).splitlines() if not line.lstrip().startswith("elif ")]
    tree = ast.parse(textwrap.dedent("\n".join(body)))
    return next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "open"
    )


def test_the_open_call_matches_the_adapters_signature() -> None:
    call = _open_call()
    bound = inspect.signature(KVCoreStore.open).bind(
        "spec", **{kw.arg: None for kw in call.keywords}
    )
    assert len(call.args) == 1
    missing = [
        name
        for name, p in inspect.signature(KVCoreStore.open).parameters.items()
        if p.default is p.empty and name not in bound.arguments
    ]
    assert missing == []


@pytest.mark.parametrize(
    ("cache_dtype", "scale_item_bytes"), [("bfloat16", 4), ("block_wise_fp8", 2)]
)
def test_the_open_call_runs_with_the_transfer_managers_attributes(
    cache_dtype: str, scale_item_bytes: int
) -> None:
    """The patch's own call, evaluated with ``self`` holding what CacheTransferManager holds."""
    manager = types.SimpleNamespace(
        storage_backend_type="kvcore:memory",
        model_id="ERNIE-4.5-0.3B-Paddle",
        rank=1,
        n_ranks=2,
        device=1,
        key_cache_shape=[64, 2, 16, 32],
        num_layers=4,
        num_extra_layers=1,
        cache_dtype=cache_dtype,
        scale_item_bytes=scale_item_bytes,
    )
    code = compile(ast.Expression(_open_call()), str(PATCH), "eval")
    store = eval(code, {"KVCoreStore": KVCoreStore, "self": manager})
    try:
        ctx = store.backend.context
        assert (ctx.namespace.split(".tp")[0], ctx.rank, ctx.world_size, ctx.device_id) == (
            "ERNIE-4.5-0.3B-Paddle",
            1,
            2,
            1,
        )
        assert ctx.layout.total_layers == 5
        assert ctx.layout.part_bytes("k") == 5 * 2 * 16 * 32 * (
            2 if cache_dtype == "bfloat16" else 1
        )
        if cache_dtype == "block_wise_fp8":
            assert ctx.layout.part_bytes("k_scale") == 5 * 2 * 16 * scale_item_bytes
    finally:
        store.close()


def test_the_key_value_branches_also_serve_kvcore() -> None:
    changed = [
        line
        for hunk in _hunks()
        for line in hunk
        if line.startswith("+") and 'in ("mooncake", "file", "kvcore")' in line
    ]
    assert len(changed) == 4, "read, read query, write-back, write-back query"
    assert any('self.storage_backend_type = "kvcore"' in _added(h) for h in _hunks())
