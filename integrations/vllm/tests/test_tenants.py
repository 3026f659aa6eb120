"""Tenants through the vLLM connector on the real CPU engine (issue 61): each request's tenant
comes from its ``cache_salt`` (mapped in ``settings.tenants``) or its
``kv_transfer_params["kvcore_tenant"]``; the store counts each tenant's loads and saves apart,
and no salt appears in the engine's log, its metrics or the store's file names."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import STATS_STEP, Prompts, file_connector, run_engine
from kvcore_vllm.session import EngineRun

SALT_A = "salt-of-team-a-5c1e"
SALT_B = "salt-of-team-b-9d2f"


def _generate(name: str, tokens: list[int], salt: str) -> dict:
    return {"op": "generate", "name": name, "max_tokens": 4,
            "prompts": [{"tokens": tokens, "cache_salt": salt}]}  # fmt: skip


def _salted_connector(tmp_path: Path, root: Path, shares: dict[str, dict]) -> dict:
    """The file connector by name, each salt mapped to its team (``shares``: each team's
    share). The salts are in a file: vLLM logs the connector's settings, which then hold its
    path only."""
    salts = tmp_path / "salts.json"
    salts.write_text(json.dumps({SALT_A: "team-a", SALT_B: "team-b"}))
    return file_connector(root, "tenants", tenants={"tenants": shares, "salts_file": str(salts)})


def _run(
    model_dir: Path, connector: dict, steps: list[dict], tmp_path: Path, name: str
) -> EngineRun:
    """The real engine in this process, through ``connector``, running ``steps``."""
    spec = {"model": str(model_dir), "connector": connector, "in_process": True, "steps": steps}
    return run_engine(spec, tmp_path, name)


def test_each_requests_tenant_is_counted_apart_and_no_salt_is_shown(
    model_dir: Path, prompts: Prompts, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    connector = _salted_connector(tmp_path, root, {"team-a": {}, "team-b": {}})
    steps = [
        _generate("A", prompts.a, SALT_A),
        _generate("B", prompts.b, SALT_B),
        {"op": "reset_prefix_cache"},
        _generate("A_again", prompts.a, SALT_A),
        STATS_STEP,
        {"op": "shutdown", "store_root": str(root)},
    ]
    run = _run(model_dir, connector, steps, tmp_path, "tenants")
    metrics = run.step("stats")["metrics"]
    tenant = {k.removeprefix("kvcore.be."): v for k, v in metrics.items() if ".tenant_" in k}
    # each tenant's saves are its own; only team-a's prompt was asked for again, and restored
    assert tenant["tenant_blocks_done.write.team-a"] > 0
    assert tenant["tenant_blocks_done.write.team-b"] > 0
    assert tenant["tenant_blocks_done.read.team-a"] > 0
    assert "tenant_blocks.read.team-b" not in tenant
    assert run.step("A_again")["num_cached_tokens"][0] > 0
    # a salt is a secret: in no log line, metric or file name
    shown = [run.log, repr(metrics)]
    shown += [str(p) for p in root.rglob("*")]
    shown += [p.read_text(errors="replace") for p in tmp_path.glob("*.log")]
    for salt in (SALT_A, SALT_B):
        assert not any(salt in text for text in shown), salt
    assert os.path.isdir(root)


def _store_stats(root: Path, namespace: str) -> dict[str, float]:
    """The kv_file store's own figures (what each tenant holds), opened after the engine."""
    import kvcore

    with kvcore.open_backend(
        "file", {"root": str(root), "rescan_interval_s": 0}, context={"namespace": namespace}
    ) as backend:
        return backend.stats()


def test_a_reserved_share_keeps_a_tenants_prompt_through_another_tenants_flood(
    model_dir: Path, prompts: Prompts, tmp_path: Path
) -> None:
    """kv_file with tenants' shares, through the connector by name: tenant A's stored prompt
    restores in full after tenant B writes ten times the store's capacity when A holds a
    reserved share of half the store, and not at all without one (B's flood then evicts it,
    least recently used first)."""
    import random

    capacity = 2 << 20
    # B: unique prompts of A's length, ten times the capacity in KV (the tiny model's KV is
    # 256 B a token in bfloat16, 512 in float32: counted here at the smaller, so B writes at
    # least ten times, whatever the dtype)
    flood_prompts = 10 * capacity // (256 * len(prompts.a)) + 1
    rng = random.Random(61)
    flood = [[rng.randrange(1, 512) for _ in range(len(prompts.a))] for _ in range(flood_prompts)]
    flood_step = {
        "op": "generate",
        "name": "flood",
        "max_tokens": 1,
        "prompts": [{"tokens": t, "cache_salt": SALT_B} for t in flood],
    }
    restored = {}
    for arm, share in (("shares", {"reserved_bytes": capacity // 2}), ("no-shares", {})):
        root = tmp_path / arm
        shares = {"team-a": share, "team-b": {}}
        connector = _salted_connector(tmp_path, root, shares)
        connector["backend_config"] = {
            "root": str(root),
            "capacity_bytes": capacity,
            "admission": "all",  # every write stored: what lets a flood in
            "tenants": {"tenants": shares},
        }
        steps = [
            _generate("A", prompts.a, SALT_A),
            flood_step,
            {"op": "reset_prefix_cache"},
            _generate("A_again", prompts.a, SALT_A),
            {"op": "shutdown", "store_root": str(root)},
        ]
        run = _run(model_dir, connector, steps, tmp_path, f"tenants-{arm}")
        assert run.step("A_again")["tokens"] == run.step("A")["tokens"]
        restored[arm] = run.step("A_again")["num_cached_tokens"][0]
        held = _store_stats(root, "tenants")
        assert held["backend_tenant_bytes_held.team-b"] > 0.4 * capacity  # the flood is in
    full = len(prompts.a) // 32 * 32
    assert restored == {"shares": full, "no-shares": 0}, restored
