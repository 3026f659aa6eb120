"""This engine's prefill rate for the load-or-recompute decision (:mod:`kvcore.load_costs`):
its step budget and attention's share from vLLM's config, and the profile an earlier engine of
the same model and settings left on this machine (:mod:`kvcore.prefill_profile`)."""

from __future__ import annotations

import logging
import os
import platform
from typing import Any

from kvcore.estimates import PrefillRate, pair_cost_of
from kvcore.prefill_profile import PrefillProfile, profile_dir
from kvcore_vllm.config import ConnectorSettings

log = logging.getLogger(__name__)


def engine_prefill(
    vllm_config: Any, settings: ConnectorSettings
) -> tuple[PrefillRate, PrefillProfile | None]:
    """The rate the scheduler feeds with the workers' step timings, seeded from this engine's
    profile where one is kept (``prefill_profile``), and that profile (kept whatever the
    ``load_policy``: an engine that always loads still times the prefills the next one needs,
    and a request may ask for ``auto`` itself)."""
    rate = PrefillRate(
        tokens_per_step=tokens_per_step(vllm_config),
        tokens_per_s=settings.prefill_tokens_per_s,  # until a step was measured
        pair_cost=pair_cost(vllm_config),  # attention's share, from the shapes
    )
    directory = profile_dir(settings.prefill_profile)
    if directory is None:
        return rate, None
    profile = PrefillProfile(rate, directory, engine_identity(vllm_config))
    seeded = profile.load()
    if seeded:
        log.info("KVCoreConnector: prefill rate seeded with %d steps from %s", seeded, profile.path)
    return rate, profile


def engine_identity(vllm_config: Any) -> dict[str, Any]:
    """What sets how fast this engine prefills: a profile is shared only by engines alike in
    all of it (the model's shapes and dtype, its quantization, the parallelism, the step
    budget, how vLLM runs the model, the device, this host's processor and threads)."""
    model = getattr(vllm_config, "model_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    hf = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    shapes = {
        name: getattr(hf, name, None)
        for name in (
            "model_type",
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
        )
    }
    try:
        from vllm import __version__ as vllm_version
        from vllm.platforms import current_platform

        device = str(current_platform.get_device_name())
    except Exception:  # a platform that cannot name its device: the type alone
        vllm_version, device = "", ""
    cache = getattr(vllm_config, "cache_config", None)
    compilation = getattr(vllm_config, "compilation_config", None)
    return {
        "engine": "vllm",
        "vllm": vllm_version,
        "model": str(getattr(model, "model", None)),
        "shapes": shapes,
        "dtype": str(getattr(model, "dtype", None)),
        "quantization": str(getattr(model, "quantization", None)),
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", None)),
        "block_size": getattr(cache, "block_size", None),
        "enforce_eager": bool(getattr(model, "enforce_eager", False)),
        "compilation_mode": str(getattr(compilation, "mode", None)),
        "tensor_parallel": getattr(parallel, "tensor_parallel_size", None),
        "pipeline_parallel": getattr(parallel, "pipeline_parallel_size", None),
        "tokens_per_step": tokens_per_step(vllm_config),
        "device_type": str(getattr(getattr(vllm_config, "device_config", None), "device_type", "")),
        "device": device,
        "host_cpu": platform.processor() or platform.machine(),
        "host_cpus": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
    }


def tokens_per_step(vllm_config: Any) -> int | None:
    """vLLM's token budget of one step (a long prefill takes several)."""
    value = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    return int(value) if value else None


def pair_cost(vllm_config: Any) -> float | None:
    """Attention's cost per token pair relative to a token's, from the model's shapes (None
    where they are not those of a plain decoder: the prefill rate then learns it from steps)."""
    model = getattr(vllm_config, "model_config", None)
    hf = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    try:
        hidden = int(hf.hidden_size)
        heads = int(hf.num_attention_heads)
        head_dim = int(getattr(hf, "head_dim", None) or hidden // heads)
        return pair_cost_of(
            layers=int(hf.num_hidden_layers),
            hidden=hidden,
            heads=heads,
            kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            intermediate=int(hf.intermediate_size),
        )
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None
