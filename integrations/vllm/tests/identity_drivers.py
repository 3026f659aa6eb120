"""kvcore's key-identity kit (:mod:`kvcore.testing.identity`) driven through the vLLM adapter.

- :class:`SchedulerDriver`: vLLM's real ``Request`` objects, hashed by vLLM's own block hasher
  (LoRA, multimodal items, prompt embeddings and salt as vLLM puts them in a block hash), given
  to the connector's real scheduler side over kv_file: the blocks its save runs name are
  stored as a worker would store them, and a *fresh* scheduler side (a new backend handle, as
  a new engine opens) answers each probe's lookup. Engine variants are real ``VllmConfig``\\ s
  that differ in one setting. Fast (no engine), so it also runs the meta-tests.
- :class:`EngineDriver`: real CPU engines (``python -m kvcore_vllm.session``): one storing
  engine, one fresh reading engine and one engine without the connector (the baseline tokens)
  per configuration; salt and LoRA per request, RoPE and weight version per engine.
"""

from __future__ import annotations

import copy
import json
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

import kvcore
from kvcore.testing.identity import IdentityDriver, Request, Served

#: What a LoRA adapter's name points to in these tests (vLLM keys an adapter by name and path).
LORA_RANK = 8


def scheduler_output(finished: Sequence[str] = ()) -> Any:
    """The fields of vLLM's ``SchedulerOutput`` the connector's scheduler side reads."""
    return SimpleNamespace(
        preempted_req_ids=set(),
        finished_req_ids=set(finished),
        scheduled_spec_decode_tokens={},
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={},
        kv_connector_block_state=None,
    )


class SchedulerDriver(IdentityDriver):
    """The connector's scheduler side with vLLM's real requests and configs (no engine).

    ``strip``: parts of the identity removed from every request before the connector sees it,
    which is what an adapter that drops that part from its keys amounts to (the meta-test).
    """

    name = "vllm connector (scheduler side, vLLM's Request and block hasher)"
    request_axes = frozenset({"cache_salt", "lora", "mm", "prompt_embeds"})
    block_size = 32
    prompt_tokens = 4 * 32 + 5

    def __init__(
        self,
        configs: Mapping[str, Any],
        root: Path,
        lora_dirs: Mapping[str, str],
        strip: frozenset[str] = frozenset(),
    ) -> None:
        self.configs = configs  # "base" and one per engine variant
        self.engine_variants = {k: k for k in configs if k != "base"}
        self.root = root
        self.lora_dirs = lora_dirs
        self.strip = strip

    def _config(self, engine: str) -> Any:
        from kvcore_vllm.config import load_settings

        config = copy.deepcopy(self.configs[engine])
        extra = dict(config.kv_transfer_config.kv_connector_extra_config)
        extra.update({"backend": "file", "backend_config": {"root": str(self.root)}})
        config.kv_transfer_config.kv_connector_extra_config = extra
        load_settings(extra)
        return config

    def _side(self, engine: str) -> Any:
        from kvcore_vllm.config import load_settings
        from kvcore_vllm.scheduler import SchedulerSide
        from test_units import _kv_cache_config
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

        config = self._config(engine)
        settings = load_settings(config.kv_transfer_config.kv_connector_extra_config)
        mc = config.model_config
        spec = (MLAAttentionSpec if mc.use_mla else FullAttentionSpec)(
            block_size=config.cache_config.block_size,
            num_kv_heads=mc.get_num_kv_heads(config.parallel_config),
            head_size=mc.get_head_size(),
            dtype=mc.dtype,
        )
        return SchedulerSide(config, _kv_cache_config(spec), settings)

    def vllm_request(self, request: Request, config: Any, max_tokens: int = 1) -> Any:
        import torch
        from kvcore_vllm.keys import hashed_request
        from vllm.lora.request import LoRARequest
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

        fields: dict[str, Any] = {}
        if request.cache_salt and "cache_salt" not in self.strip:
            fields["cache_salt"] = request.cache_salt
        if request.lora and "lora" not in self.strip:
            lora_id = sorted(self.lora_dirs).index(request.lora) + 1
            fields["lora_request"] = LoRARequest(
                request.lora, lora_id, self.lora_dirs[request.lora]
            )
        if request.mm and "mm" not in self.strip:
            # one image behind placeholder tokens 8 .. 47: the same token ids for any image
            fields["mm_features"] = [
                MultiModalFeatureSpec(
                    data=None,
                    modality="image",
                    identifier=request.mm,
                    mm_position=PlaceholderRange(offset=8, length=40),
                )
            ]
        if request.prompt_embeds and "prompt_embeds" not in self.strip:
            seed = int.from_bytes(request.prompt_embeds.encode()[-4:], "big")
            generator = torch.Generator().manual_seed(seed)
            fields["prompt_embeds"] = torch.randn(len(request.tokens), 16, generator=generator)
        return hashed_request(config, request.id, request.tokens, max_tokens=max_tokens, **fields)

    def serve(self, stored: Sequence[Request], probes: Sequence[Request]) -> Mapping[str, Served]:
        from kvcore_vllm.context import backend_context

        side = self._side("base")
        backend = kvcore.open_backend(
            "file",
            {"root": str(self.root)},
            context=backend_context(side.settings, side.layout, 0, 1),
        )
        part = side.layout.part_bytes("k")
        buf = np.full(2 * part, 7, np.uint8)
        for request in stored:
            vreq = self.vllm_request(request, self._config("base"))
            vreq.num_computed_tokens = vreq.num_tokens
            side.get_num_new_matched_tokens(vreq, 0)  # as vLLM asks before it schedules
            blocks = list(range(vreq.num_tokens // self.block_size + 1))
            side.request_finished(vreq, blocks)
            for run in side.build_connector_meta(scheduler_output()).saves:
                host = kvcore.HostBuffers(
                    ptrs=((buf.ctypes.data, buf.ctypes.data + part),) * len(run.keys),
                    nbytes=(part, part),
                )
                written = backend.write(
                    backend.request(run.req_id, run.keys, start_block=run.start_block, host=host)
                )
                assert int(written) == len(run.keys), written
        backend.close()
        side.close()
        out: dict[str, Served] = {}
        readers: dict[str, Any] = {}
        for probe in probes:
            reader = readers.get(probe.engine)
            if reader is None:
                reader = readers[probe.engine] = self._side(probe.engine)
            vreq = self.vllm_request(probe, self._config(probe.engine))
            found, _ = reader.get_num_new_matched_tokens(vreq, 0)
            restorable = (vreq.num_tokens - 1) // self.block_size * self.block_size
            out[probe.id] = Served(found, restorable)
        for reader in readers.values():
            reader.close()
        return out


# -- real engines ------------------------------------------------------------------------------


def write_lora_adapter(path: Path, model_dir: Path, seed: int) -> Path:
    """A PEFT-format LoRA adapter on q/k/v with random A *and* B (PEFT's own init leaves B zero,
    which would change nothing and make any check of it vacuous)."""
    if (path / "adapter_model.safetensors").exists():
        return path
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    outs = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "k_proj": config["num_key_value_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(
                LORA_RANK, hidden, generator=generator
            ).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(
                out, LORA_RANK, generator=generator
            ).to(torch.bfloat16)
    tmp = path.with_name(path.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": LORA_RANK,
                "lora_alpha": 2 * LORA_RANK,
                "target_modules": list(outs),
                "bias": "none",
                "base_model_name_or_path": str(model_dir),
                "task_type": "CAUSAL_LM",
            }
        )
    )
    tmp.rename(path)
    return path


def engine_prompt(request: Request, lora_dirs: Mapping[str, str]) -> dict[str, Any]:
    """A session prompt (see ``kvcore_vllm.session``) for one kit request."""
    prompt: dict[str, Any] = {"tokens": list(request.tokens)}
    if request.cache_salt:
        prompt["cache_salt"] = request.cache_salt
    if request.lora:
        prompt["lora"] = {"name": request.lora, "path": lora_dirs[request.lora]}
    if request.prompt_embeds:
        # the embeddings stand in for the tokens: drawn from a seed of the name *and* the
        # case's tokens, so one name gives the same embeddings within a case and others in
        # another case (which must not see this case's blocks)
        seed = zlib.crc32(repr((request.prompt_embeds, request.tokens)).encode())
        prompt["embeds"] = {"seed": seed, "hidden": 128, "scale": 0.05}
    return prompt


class EngineDriver(IdentityDriver):
    """Real CPU engines through ``KVCoreConnector`` over kv_file, all prompts of a configuration
    in one engine: one storing engine, then per configuration one fresh reading engine and
    one engine without the connector."""

    name = "vllm connector (real CPU engines)"
    request_axes = frozenset({"cache_salt", "lora"})
    prompt_tokens = 3 * 32 + 20  # 3 full blocks restorable
    max_tokens = 12

    def __init__(
        self,
        run_engine: Any,
        workdir: Path,
        model_dir: Path,
        lora_dirs: Mapping[str, str],
        engines: Mapping[str, dict[str, Any]],
    ) -> None:
        self.run_engine = run_engine
        self.workdir = workdir
        self.model_dir = model_dir
        self.lora_dirs = lora_dirs
        self.engines = engines  # configuration -> {"spec": {...}, "connector": {...}}
        self.engine_variants = {k: k for k in engines if k != "base"}
        self.runs: dict[str, Any] = {}
        if engines["base"].get("spec", {}).get("enable_prompt_embeds"):
            self.request_axes = self.request_axes | {"prompt_embeds"}

    def _spec(self, engine: str, connector: bool) -> dict[str, Any]:
        conf = self.engines[engine]
        root = str(self.workdir / "store")
        spec = {
            "model": str(self.model_dir),
            "enable_lora": True,
            "max_lora_rank": LORA_RANK,
            **conf.get("spec", {}),
        }
        spec["connector"] = (
            {
                "backend": "file",
                "backend_config": {"root": root},
                "namespace": "identity",
                **conf.get("connector", {}),
            }
            if connector
            else None
        )
        return spec

    def _generate(self, name: str, requests: Sequence[Request]) -> list[dict[str, Any]]:
        steps: list[dict[str, Any]] = []
        for request in requests:
            steps += [
                {"op": "reset_prefix_cache"},
                {
                    "op": "generate",
                    "name": request.id,
                    "prompts": [engine_prompt(request, self.lora_dirs)],
                    "max_tokens": self.max_tokens,
                },
            ]
        return steps

    def serve(self, stored: Sequence[Request], probes: Sequence[Request]) -> Mapping[str, Served]:
        store_spec = self._spec("base", connector=True)
        store_spec["steps"] = self._generate("store", stored)
        self.runs["store"] = self.run_engine(store_spec, self.workdir, "identity-store")
        out: dict[str, Served] = {}
        for engine in sorted({p.engine for p in probes}):
            mine = [p for p in probes if p.engine == engine]
            before = self.engines[engine].get("before")
            if before is not None:  # e.g. new weights at the model's path
                before()
            read_spec = self._spec(engine, connector=True)
            read_spec["steps"] = self._generate("read", mine)
            base_spec = self._spec(engine, connector=False)
            base_spec["steps"] = self._generate("baseline", mine)
            read = self.runs[f"read-{engine}"] = self.run_engine(
                read_spec, self.workdir, f"identity-read-{engine}"
            )
            base = self.runs[f"baseline-{engine}"] = self.run_engine(
                base_spec, self.workdir, f"identity-baseline-{engine}"
            )
            for probe in mine:
                got, want = read.step(probe.id), base.step(probe.id)
                out[probe.id] = Served(
                    restored_tokens=got["num_cached_tokens"][0],
                    restorable_tokens=(len(probe.tokens) - 1) // 32 * 32,
                    tokens=tuple(got["tokens"][0]),
                    baseline=tuple(want["tokens"][0]),
                )
        return out


# -- the secondary tier --------------------------------------------------------------------------


class TierDriver(SchedulerDriver):
    """``KVCoreTier`` over kv_file with vLLM's chunk keys of real requests: vLLM's offloading
    keys a chunk (``blocks_per_chunk`` 1) by the request's block hash and the KV cache group
    (``make_offload_key``). Chunks are stored by store jobs, as the tiering manager submits
    them; a fresh tier of each configuration answers the probes with its asynchronous lookups,
    as the manager asks them. A configuration's model settings reach the tier as the engine's
    current vLLM config."""

    name = "vllm secondary tier (KVCoreTier, vLLM's chunk keys)"

    def _tier(self, engine: str, tensor: Any) -> Any:
        from tier_helpers import make_tier, offloading_spec
        from vllm.config import set_current_vllm_config

        config = self._config(engine)
        extra = config.kv_transfer_config.kv_connector_extra_config
        settings = {"weight_version": extra["weight_version"]} if "weight_version" in extra else {}
        with set_current_vllm_config(config):
            tier, _ = make_tier("file", str(self.root), tensor, spec=offloading_spec(), **settings)
        return tier

    def chunk_keys(self, request: Request, engine: str) -> list[bytes]:
        from vllm.v1.kv_offload.base import make_offload_key

        vreq = self.vllm_request(request, self._config(engine))
        full = vreq.num_tokens // self.block_size
        return [make_offload_key(h, 0) for h in vreq.block_hashes[:full]]

    def serve(self, stored: Sequence[Request], probes: Sequence[Request]) -> Mapping[str, Served]:
        from tier_helpers import aligned_tensor, drain, lookup_and_wait, make_job
        from vllm.v1.kv_offload.base import LookupResult, ReqContext

        tensor = aligned_tensor(random=True)
        tier = self._tier("base", tensor)
        for job_id, request in enumerate(stored):
            ks = self.chunk_keys(request, "base")
            tier.submit_store(make_job(job_id, ks, list(range(len(ks)))))
            assert all(r.success for r in drain(tier))
        tier.shutdown()
        out: dict[str, Served] = {}
        for engine in sorted({p.engine for p in probes}):
            reader = self._tier(engine, tensor)
            for probe in (p for p in probes if p.engine == engine):
                ks = self.chunk_keys(probe, engine)
                found = lookup_and_wait(reader, ks, ReqContext(req_id=probe.id))
                hits = 0
                for result in found:
                    if result is not LookupResult.HIT:
                        break
                    hits += 1
                out[probe.id] = Served(hits * self.block_size, len(ks) * self.block_size)
            reader.shutdown()
        return out
