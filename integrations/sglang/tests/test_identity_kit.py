"""kvcore's key-identity kit on the SGLang adapter, with SGLang's own page keys.

SGLang 0.5.23 keys a storage page by ``get_storage_hash_str``: the chained hash of the page's
tokens, seeded by the request's namespace (its ``extra_key``, which carries the LoRA adapter's
``lora_id``, and its ``cache_salt``). A multimodal item reaches the page key through its token
ids: SGLang replaces an item's placeholder tokens by pad values derived from the item's hash.
Those are SGLang's keys, computed here by SGLang's own functions; the adapter adds what they do
not carry: the model and every server argument that changes K/V (published by SGLang's
scheduler: model path, dtype, quantization, ``json_model_override_args`` such as RoPE, ...),
the page format, the TP layout and the weight version.

Each "engine" configuration is a real ``ServerArgs`` published as SGLang's scheduler publishes
it, and a storage built by SGLang's factory on a real host pool, writing to one kv_file root;
probes are answered by storages built afresh.

Not covered: prompt embeddings. SGLang gives an ``input_embeds`` request fake token ids
(``[1] * n``) and puts no digest of the embeddings in its page keys; the adapter sees only the
keys, so it can neither key nor refuse such pages (docs/sglang.md).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import page_indices
from kvcore_sglang.testing import (
    create_storage,
    extra_config,
    fill_random,
    mha_host_pool,
    storage_config,
)

from kvcore.testing.identity import IdentityDriver, Request, Served, run_identity_kit

PAGE = 16
HERE = Path(__file__).resolve().parent


def publish_server_args(model_path: str, **overrides: Any) -> Any:
    """SGLang's real ``ServerArgs``, published as its scheduler process publishes them."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_path, device="cpu", **overrides)
    publish(args, role="scheduler")
    return args


def _mm_tokens(tokens: Sequence[int], item: str) -> list[int]:
    """The prompt as SGLang schedules it: an image's placeholder tokens 8 .. 47 replaced by the
    pad values SGLang derives from the image's hash."""
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem

    mm = MultimodalDataItem(modality=Modality.IMAGE)
    mm.set_hash(int.from_bytes(hashlib.sha256(item.encode()).digest()[:8], "big"))
    return [*tokens[:8], *mm.padding_sequence(40), *tokens[48:]]


class SGLangDriver(IdentityDriver):
    name = "sglang adapter (SGLang's page keys and storage factory)"
    request_axes = frozenset({"cache_salt", "lora", "mm"})
    prompt_tokens = 4 * PAGE + 5

    def __init__(
        self, root: Path, engines: Mapping[str, dict[str, Any]], strip: frozenset[str] = frozenset()
    ) -> None:
        self.root = root
        self.engines = engines  # name -> {"server_args": {...}, "storage": {...}, "extra": {...}}
        self.engine_variants = {k: k for k in engines if k != "base"}
        self.strip = strip

    def page_keys(self, request: Request) -> list[str]:
        from sglang.srt.lora.lora_registry import LoRARef
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        tokens = list(request.tokens)
        if request.mm and "mm" not in self.strip:
            tokens = _mm_tokens(tokens, request.mm)
        n = len(tokens) // PAGE * PAGE
        lora_id = (
            LoRARef.deterministic_id(request.lora, f"/adapters/{request.lora}")
            if request.lora and "lora" not in self.strip
            else None
        )
        salt = request.cache_salt if "cache_salt" not in self.strip else None
        key = RadixKey(array("q", tokens[:n]), extra_key=lora_id, cache_salt=salt)
        return list(get_storage_hash_str(key, None, page_size=PAGE))

    @staticmethod
    def _dtype(name: str | None) -> Any:
        import torch

        return {"float16": torch.float16}.get(name or "", torch.bfloat16)

    def _storage(self, engine: str) -> tuple[Any, Any]:
        conf = self.engines[engine]
        args = publish_server_args(**conf["server_args"])
        pool = mha_host_pool(page_size=PAGE, dtype=self._dtype(args.dtype))
        fill_random(pool, 1)
        extra = extra_config("file", {"root": str(self.root)}, **conf.get("extra", {}))
        identity = {"model_name": conf["server_args"]["model_path"], **conf.get("storage", {})}
        return create_storage("dynamic", storage_config(extra, **identity), pool), pool

    def serve(self, stored: Sequence[Request], probes: Sequence[Request]) -> Mapping[str, Served]:
        writer, pool = self._storage("base")
        for request in stored:
            keys = self.page_keys(request)
            assert writer.batch_set_v1(keys, page_indices(pool, 0, len(keys))) == [True] * len(keys)
        writer.close()
        out: dict[str, Served] = {}
        for engine in sorted({p.engine for p in probes}):
            reader, _ = self._storage(engine)
            for probe in (p for p in probes if p.engine == engine):
                keys = self.page_keys(probe)
                out[probe.id] = Served(reader.batch_exists(keys) * PAGE, len(keys) * PAGE)
            reader.close()
        return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Two model directories with a config SGLang's ServerArgs can read (no weights needed)."""
    from sglang.srt.runtime_context import reset_context

    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for name, layers in (("model-a", 2), ("model-b", 3)):
        path = root / name
        path.mkdir()
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 512,
            "max_position_embeddings": 2048,
            "torch_dtype": "bfloat16",
        }
        (path / "config.json").write_text(json.dumps(config))
        dirs[name] = str(path)
    yield dirs
    reset_context()  # SGLang's teardown: the other tests run without published server args


def _engines(dirs: dict[str, str]) -> dict[str, dict[str, Any]]:
    base = {"model_path": dirs["model-a"]}
    rope = json.dumps({"rope_theta": 20000.0})
    return {
        "base": {"server_args": base},
        "rope": {"server_args": {**base, "json_model_override_args": rope}},
        "dtype": {"server_args": {**base, "dtype": "float16"}},
        "model": {"server_args": {"model_path": dirs["model-b"]}},
        "weight_version": {"server_args": base, "extra": {"weight_version": "v2"}},
        "tp_size": {"server_args": base, "storage": {"tp_size": 2}},
    }


def test_sglang_page_keys_and_the_adapter_pass_the_identity_kit(
    model_dirs: dict[str, str], tmp_path: Path
) -> None:
    report = run_identity_kit(SGLangDriver(tmp_path / "store", _engines(model_dirs)))
    assert not report.failures, report.summary()
    print(report.summary())
    # 1 fresh-process pair, 4 per request part (salt, LoRA, image), the name-vs-salt pair and
    # 6 engine axes... of which "base" is none: 5
    assert report.pairs == 1 + 3 * 4 + 1 + 5


@pytest.mark.parametrize("dropped", ["cache_salt", "lora", "mm"])
def test_keys_that_drop_a_part_fail_the_kit(
    model_dirs: dict[str, str], tmp_path: Path, dropped: str
) -> None:
    driver = SGLangDriver(tmp_path / "store", _engines(model_dirs), strip=frozenset({dropped}))
    assert run_identity_kit(driver).failed_axes() == {dropped}


def test_an_adapter_blind_to_server_args_fails_the_kit(
    model_dirs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the model's settings in its namespace, the adapter would serve pages computed
    under other RoPE settings or another dtype's server."""
    import kvcore_sglang.settings as settings

    monkeypatch.setattr(settings, "model_settings", lambda: {})
    report = run_identity_kit(SGLangDriver(tmp_path / "store", _engines(model_dirs)))
    # the dtype also changes the page format (its bytes): that axis stays apart regardless
    assert report.failed_axes() == {"rope"}, report.summary()
