"""A key is the KV's identity: kvcore's identity kit on the vLLM connector.

- On the connector's scheduler side with vLLM's real requests, block hasher and configs: every
  part of a request's identity vLLM carries (salt, LoRA, multimodal item, prompt embeddings)
  and every engine setting tried (RoPE, weight version, dtype, block size, model, hash
  algorithm, an MLA model under the same model id). The meta-tests: an adapter that drops
  the salt, the LoRA adapter or the multimodal item from its keys fails the kit on exactly
  that part.
- On real CPU engines (the newcomer's experience): tenant B never restores tenant A's blocks,
  a request without the adapter never restores the adapter's KV and generates exactly the
  tokens of an engine without the connector, and both restore their own blocks in a fresh
  engine; prompt embeddings of the same length are kept apart and the same ones shared;
  other RoPE settings and other weights (new weight version) restore nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import BLOCK_SIZE, run_engine
from identity_drivers import EngineDriver, SchedulerDriver, write_lora_adapter
from kvcore_vllm.session import write_model

from kvcore.testing.identity import check_identity, run_identity_kit

#: RoPE settings far from the model's (theta 10000): tokens change, so the check is not vacuous
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}


def _config(model_dir: Path, **overrides: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    connector = {"backend": "memory", "namespace": "identity"}
    connector.update(overrides.pop("connector", {}))
    args = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "block_size": BLOCK_SIZE,
        "max_model_len": 2048,
        "enable_lora": True,
        "max_lora_rank": 8,
        "kv_transfer_config": {
            "kv_connector": "KVCoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": connector,
        },
        **overrides,
    }
    config = EngineArgs(**args).create_engine_config()
    config.parallel_config.distributed_executor_backend = "uni"
    return config


@pytest.fixture(scope="module")
def lora_dirs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {
        name: str(write_lora_adapter(root / name, model_dir, seed))
        for seed, name in enumerate(("adapter-a", "adapter-b"), start=1)
    }


@pytest.fixture(scope="module")
def configs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    other_model = write_model(tmp_path_factory.mktemp("other") / "tiny-other", "tiny", seed=1)
    mla_model = write_model(tmp_path_factory.mktemp("mla") / "tiny-mla", "mla")
    return {
        "base": _config(model_dir),
        "rope": _config(model_dir, hf_overrides=ROPE),
        "weight_version": _config(model_dir, connector={"weight_version": "v2"}),
        "dtype": _config(model_dir, dtype="float16"),
        "model": _config(other_model),
        "hash_algo": _config(model_dir, prefix_caching_hash_algo="sha256_cbor"),
        "block_size": _config(model_dir, block_size=16),
        # an MLA model the operator gave the base model's id: its latent blocks must still
        # never restore into the model with K and V, for the same tokens
        "mla": _config(mla_model, connector={"model_id": str(model_dir)}),
    }


def _driver(configs: dict[str, Any], tmp_path: Path, lora_dirs: dict[str, str], **kw: Any):
    return SchedulerDriver(configs, tmp_path / "store", lora_dirs, **kw)


def test_the_connectors_keys_pass_the_identity_kit(
    configs: dict[str, Any], tmp_path: Path, lora_dirs: dict[str, str]
) -> None:
    report = check_identity(_driver(configs, tmp_path, lora_dirs))
    print(report.summary())
    # 1 fresh-process pair, 4 per request part (4 parts), the name-vs-salt pair, 7 engine axes
    assert report.pairs == 1 + 4 * 4 + 1 + 7


@pytest.mark.parametrize("dropped", ["cache_salt", "lora", "mm", "prompt_embeds"])
def test_an_adapter_that_drops_a_part_of_the_identity_fails_the_kit(
    configs: dict[str, Any], tmp_path: Path, lora_dirs: dict[str, str], dropped: str
) -> None:
    report = run_identity_kit(_driver(configs, tmp_path, lora_dirs, strip=frozenset({dropped})))
    assert report.failed_axes() == {dropped}, report.summary()


def test_hashes_seeded_per_process_share_nothing_and_say_so(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """With xxhash and no PYTHONHASHSEED vLLM seeds block hashes at random per process: no key
    could name a block for another process, so every lookup is a miss and nothing is saved."""
    from identity_drivers import scheduler_output
    from kvcore_vllm.config import load_settings
    from kvcore_vllm.keys import hashed_request
    from kvcore_vllm.scheduler import SchedulerSide
    from test_units import _kv_cache_config

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    config = _config(
        model_dir,
        prefix_caching_hash_algo="xxhash",
        connector={"backend": "file", "backend_config": {"root": str(tmp_path)}},
    )
    settings = load_settings(config.kv_transfer_config.kv_connector_extra_config)
    with caplog.at_level("WARNING"):
        side = SchedulerSide(config, _kv_cache_config(), settings)
    assert "KVCoreConnector shares nothing: prefix_caching_hash_algo='xxhash'" in caplog.text
    request = hashed_request(config, "r", list(range(1, 120)))
    request.num_computed_tokens = request.num_tokens
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert side.request_finished(request, [0, 1, 2, 3]) == (False, None)
    assert side.build_connector_meta(scheduler_output()).saves == []
    counts = side.counters.totals()
    assert counts["lookup_refused_unshared_hashes"] == 1
    assert counts["save_refused_unshared_hashes"] == 1
    side.close()


# -- real engines --------------------------------------------------------------------------------


def sharpen_attention(model: Path, factor: float = 24.0) -> None:
    """Scale the random model's query and key projections: at its initial scale attention is
    near uniform and positions barely matter, so other RoPE settings would change no token and
    the RoPE case would prove nothing."""
    from safetensors.torch import load_file, save_file

    path = model / "model.safetensors"
    tensors = load_file(str(path))
    for name in tensors:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = (tensors[name].float() * factor).to(tensors[name].dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_real_engines_keep_tenants_adapters_rope_and_weights_apart(
    model_dir: Path, tmp_path: Path, lora_dirs: dict[str, str]
) -> None:
    """One storing engine, then per configuration a fresh reading engine and one without the
    connector: every pair of the kit on restored tokens *and* generated tokens."""
    own_model = tmp_path / "model"
    shutil.copytree(model_dir, own_model)  # its weights change for the weight-version case
    sharpen_attention(own_model)
    swapped = write_model(tmp_path / "weights-v2", "tiny", seed=7)

    def new_weights() -> None:
        shutil.copy(swapped / "model.safetensors", own_model / "model.safetensors")

    engines = {
        "base": {"spec": {"enable_prompt_embeds": True}},
        "rope": {"spec": {"hf_overrides": ROPE, "enable_lora": False}},
        "weight_version": {
            "spec": {"enable_lora": False},
            "connector": {"weight_version": "v2"},
            "before": new_weights,
        },
    }
    driver = EngineDriver(run_engine, tmp_path, own_model, lora_dirs, engines)
    driver.prompt_tokens = 600
    report = check_identity(driver)
    print(report.summary())
    by_name = {c.name.split("-", 1)[1]: c for c in report.cases}
    store = driver.runs["store"]
    # the newcomer's two defects: 576 of 576 tokens restored across tenants, and the adapter's
    # KV restored for the base model, with other tokens
    for name in ("cache_salt-other", "lora-stored-probe-without"):
        case = by_name[name]
        assert driver.runs["read-base"].step(case.probe.id)["num_cached_tokens"] == [0]
    assert driver.runs["read-base"].step(by_name["cache_salt-same"].probe.id)[
        "num_cached_tokens"
    ] == [576]
    assert driver.runs["read-base"].step(by_name["lora-same"].probe.id)["num_cached_tokens"] == [
        576
    ]
    # not vacuous: the adapter, the RoPE settings and the new weights each change the tokens
    assert report.pairs == 1 + 3 * 4 + 1 + 2  # salt, LoRA, prompt embeddings; RoPE, weights
    assert driver.runs["read-base"].step(by_name["prompt_embeds-same"].probe.id)[
        "num_cached_tokens"
    ] == [576]
    for name, engine in (
        ("lora-stored-probe-without", "base"),
        ("prompt_embeds-other", "base"),
        ("rope-other-engine", "rope"),
        ("weight_version-other-engine", "weight_version"),
    ):
        case = by_name[name]
        stored_tokens = store.step(case.stored.id)["tokens"][0]
        probe_tokens = driver.runs[f"baseline-{engine}"].step(case.probe.id)["tokens"][0]
        assert stored_tokens != probe_tokens, f"{name}: the variant changes no token"


# -- the secondary tier --------------------------------------------------------------------------


def test_the_tiers_chunk_keys_pass_the_identity_kit(
    configs: dict[str, Any], tmp_path: Path, lora_dirs: dict[str, str]
) -> None:
    from identity_drivers import TierDriver

    driver = TierDriver(configs, tmp_path / "store", lora_dirs)
    report = check_identity(driver)
    print(report.summary())
    assert report.pairs == 1 + 4 * 4 + 1 + 7  # the MLA model included


def test_a_tier_that_cannot_see_the_engines_settings_shares_with_no_other_process(
    tmp_path: Path,
) -> None:
    """Without a vLLM config in scope the tier keys chunks for its own process: another
    process (another scope marker) never finds them."""
    import subprocess
    import sys

    script = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from tier_helpers import make_tier;"
        "tier, _ = make_tier('file', sys.argv[2]); print('PREFIX', tier.keys.prefix)"
    )
    prefixes = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path)],
            capture_output=True,
            text=True,
            check=True,
        )
        prefixes.append([x for x in proc.stdout.splitlines() if x.startswith("PREFIX")][-1])
        assert "keyed for this process alone" in proc.stderr + proc.stdout
    assert prefixes[0] != prefixes[1]
