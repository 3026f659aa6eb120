"""Block keys: vLLM's own block hashes of the request, scoped to this engine's KV.

A key is what makes a block's KV what it is. vLLM already hashes every request-level part of
that identity into ``request.block_hashes``, each tagged by kind: the tokens of the block and
of every block before it, the LoRA adapter (name and path), each multimodal item's identifier
and offset, prompt-embedding digests and the ``cache_salt``. kvcore keys a block by that hash
(:class:`kvcore.keys.ScopedKeys`: the scope's digest, then vLLM's hash), so two requests share
a stored block exactly when vLLM's own prefix cache would let them share a GPU block, and only
between engines whose scope agrees: the model and every model setting that changes K/V values
for the same weights (:func:`model_settings`), the cache's physical form, the block hash
algorithm and the namespace. TP rank and world size are not in the key: kvcore puts them in
every object name (each rank stores its own slice of the heads).

vLLM's hashes are the same in every process with a cryptographic ``prefix_caching_hash_algo``
(``sha256``, ``sha256_cbor``: a fixed seed) or when ``PYTHONHASHSEED`` is set. With
``xxhash`` and no ``PYTHONHASHSEED`` each process seeds its hashes at random: then no key
could name a block for another process, and the connector shares nothing
(:func:`hashes_shared`), as it says at start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import kvcore
from kvcore.keys import THIS_PROCESS_ONLY, ObjectName, ScopedKeys
from kvcore_vllm.config import ConnectorSettings, TierSettings
from kvcore_vllm.context import SlicePlan, slice_plan
from kvcore_vllm.layout import CacheGroup

__all__ = [
    "KEY_FORMAT",
    "ChunkKeys",
    "RequestKeys",
    "chunk_scope",
    "engine_block_keys",
    "engine_layout",
    "engine_object_names",
    "engine_slice_plan",
    "hashed_request",
    "hashes_shared",
    "key_scope",
    "model_identity",
    "model_settings",
    "prompt_block_hashes",
    "tier_engine_config",
]

#: What an object holds and how it is keyed; another value never matches. 3: keyed by vLLM's
#: block hashes (2, before: kvcore's own chain over token ids alone, which left LoRA,
#: multimodal items, prompt embeddings and the salt out).
KEY_FORMAT = "3"

#: hf_config entries that do not change K/V: where the files were read from, and by which
#: transformers release
_CONFIG_NOISE = frozenset({"_name_or_path", "name_or_path", "transformers_version"})


def model_identity(vllm_config: Any, settings: ConnectorSettings | TierSettings) -> str:
    """The configured ``model_id``, else vLLM's model name or path plus its revision."""
    if settings.model_id:
        return settings.model_id
    model_config = vllm_config.model_config
    revision = getattr(model_config, "revision", None) or ""
    return f"{model_config.model}@{revision}" if revision else str(model_config.model)


def _canonical(value: Any) -> str:
    """A stable text for a config value (dicts sorted; callables by qualified name)."""

    def default(obj: Any) -> Any:
        if callable(obj):
            return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"
        for attr in ("model_dump", "to_dict"):
            if hasattr(obj, attr):
                return getattr(obj, attr)()
        return str(obj)

    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=default)


def _hf_config_digest(hf_config: Any) -> str:
    """SHA-256 (first 128 bits) of the model's config as vLLM loaded it, overrides applied:
    RoPE type, theta and scaling, sliding windows, quantization config, attention and
    normalisation settings, every architecture field."""
    as_dict = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    kept = {k: v for k, v in as_dict.items() if k not in _CONFIG_NOISE and not k.startswith("_")}
    return hashlib.sha256(_canonical(kept).encode()).hexdigest()[:32]


def _rope(hf_config: Any) -> str:
    text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
    fields = {}
    for name in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"):
        value = getattr(text_config, name, None)
        if value is not None:
            fields[name] = value
    return _canonical(fields)


def model_settings(vllm_config: Any) -> dict[str, str]:
    """The model settings that change K/V values for the same weights, as key-scope fields.

    Besides the named fields, ``model_config`` digests the model's whole config as vLLM loaded
    it (``hf_overrides`` applied), so a setting this list does not name still separates keys.
    """
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    get_window = getattr(mc, "get_sliding_window", None)
    return {
        "model_config": _hf_config_digest(mc.hf_config),
        "rope": _rope(mc.hf_config),
        "hf_overrides": _canonical(getattr(mc, "hf_overrides", None) or {}),
        "dtype": str(mc.dtype).removeprefix("torch."),
        "quantization": str(getattr(mc, "quantization", None) or ""),
        "quantization_config": _canonical(getattr(mc, "quantization_config", None)),
        "sliding_window": str(get_window() if get_window is not None else None),
        "disable_sliding_window": str(bool(getattr(mc, "disable_sliding_window", False))),
        "model_weights": str(getattr(mc, "model_weights", "") or ""),
        "revision": str(getattr(mc, "revision", None) or ""),
        "model_impl": str(getattr(mc, "model_impl", "auto")),
        "model_class_overrides": _canonical(getattr(mc, "model_class_overrides", None) or {}),
        "runner": str(getattr(mc, "runner_type", "")),
        "cache_dtype": str(getattr(cc, "cache_dtype", "auto")),
        "calculate_kv_scales": str(bool(getattr(cc, "calculate_kv_scales", False))),
        # a model whose recurrent state vLLM caches per block: the state's dtypes (a padded
        # state page has the same size in float32 and bfloat16); other models' keys unchanged
        **(
            {
                "mamba_cache_dtype": str(getattr(cc, "mamba_cache_dtype", "auto")),
                "mamba_ssm_cache_dtype": str(getattr(cc, "mamba_ssm_cache_dtype", "auto")),
            }
            if str(getattr(cc, "mamba_cache_mode", "none")) != "none"
            else {}
        ),
    }


def _group_text(group: CacheGroup) -> str:
    layers = hashlib.sha256(",".join(group.layer_names).encode()).hexdigest()[:16]
    text = f"{group.index}:{group.kind}:{group.window}:{layers}"
    return text if group.state is None else f"{text}:{group.state}"


def hash_algo(vllm_config: Any) -> str:
    return str(vllm_config.cache_config.prefix_caching_hash_algo)


def hashes_shared(vllm_config: Any) -> str | None:
    """None when vLLM's block hashes are the same in every process; else why not."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    algo = hash_algo(vllm_config)
    not_crypto = getattr(kv_cache_utils, "_NON_CRYPTO_HASH_FUNCTIONS", None)
    if not_crypto is not None:
        random_seed = get_hash_fn_by_name(algo) in not_crypto
    else:  # a vLLM without the set: the algorithms it documents as seeded at random
        random_seed = algo.startswith("xxhash")
    if random_seed and os.environ.get("PYTHONHASHSEED") is None:
        return (
            f"prefix_caching_hash_algo={algo!r} seeds vLLM's block hashes at random in every "
            "process (PYTHONHASHSEED is not set)"
        )
    return None


def key_scope(
    vllm_config: Any,
    settings: ConnectorSettings,
    layout: kvcore.CacheLayout,
    group: CacheGroup | None = None,
) -> kvcore.KeyScope:
    """Everything besides the request that must match for two engines to share a block;
    ``group``: the KV cache group of a hybrid model the keys are for (its kind, window and
    layers are in the scope, so groups never read each other's objects)."""
    import vllm
    from vllm.platforms import current_platform

    major_minor = ".".join(str(vllm.__version__).split(".")[:2])
    attention = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    extra = {
        # the physical block format: vLLM release, device type and attention backend decide
        # how K and V sit inside a block, so objects are only shared when they agree
        "engine": f"vllm-{major_minor}",
        "device": str(current_platform.device_type),
        "attention": str(attention or "auto"),
        "kv_dtype": layout.dtype.value,
        "block_size": str(layout.block_size),
        "kv_heads": str(layout.num_heads),
        "head_dim": str(layout.head_dim),
        "layers": str(layout.num_layers),
        # what a key is made of: vLLM's block hashes, by this algorithm
        "block_hash": hash_algo(vllm_config),
        "object_format": KEY_FORMAT,
        # a cache that is not K and V, objects of one KV head each (only named where they
        # apply: other engines' keys stay as they were)
        **({"kv_spec": "mla"} if _uses_mla(vllm_config) else {}),
        **({"object_layout": "per_head"} if _per_head(vllm_config, settings) else {}),
        **({"kv_group": _group_text(group)} if group is not None else {}),
        **{f"model.{name}": value for name, value in model_settings(vllm_config).items()},
    }
    return kvcore.KeyScope(
        model=model_identity(vllm_config, settings), namespace=settings.namespace, extra=extra
    )


class RequestKeys:
    """The keys of a request's full blocks, from the block hashes vLLM keeps on the request.

    vLLM hashes a request at ``hash_block_size`` granularity; a block of ``block_size`` tokens
    is named by the hash at its last boundary (that hash covers the whole prefix), as vLLM's
    own ``BlockHashListWithBlockSize`` does.
    """

    __slots__ = ("block_size", "scale", "scoped")

    def __init__(self, scope: kvcore.KeyScope, block_size: int, hash_block_size: int) -> None:
        if block_size % hash_block_size:
            raise ValueError(
                f"block_size {block_size} is not a multiple of vLLM's hash block size "
                f"{hash_block_size}"
            )
        self.scoped = ScopedKeys(scope)
        self.block_size = block_size
        self.scale = block_size // hash_block_size

    def blocks_keyed(self, request: Any) -> int:
        """Full blocks of ``request`` that vLLM has hashed (and so that have a key)."""
        return len(getattr(request, "block_hashes", None) or ()) // self.scale

    def keys(self, request: Any, start: int, stop: int) -> list[str]:
        """Keys of blocks ``start .. stop - 1`` (``stop`` at most :meth:`blocks_keyed`)."""
        hashes = request.block_hashes
        scale = self.scale
        if stop * scale > len(hashes):
            raise ValueError(
                f"request {request.request_id}: {stop} blocks asked, vLLM hashed "
                f"{len(hashes) // scale}"
            )
        key = self.scoped.key
        return [key(hashes[(i + 1) * scale - 1]) for i in range(start, stop)]

    def block_hash(self, key: str) -> bytes | None:
        """vLLM's block hash of ``key``; None for a key of another scope."""
        return self.scoped.digest(key)


def engine_layout(vllm_config: Any) -> kvcore.CacheLayout:
    """The layout a running engine's connector uses, from the model config alone.

    The connector itself derives it from vLLM's ``KVCacheConfig``; this version needs only the
    ``vllm_config`` (``LLM.llm_engine.vllm_config``), for tools that name stored objects.
    """
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    from kvcore_vllm.layout import kv_dtype_name

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    cache_dtype = getattr(cc, "cache_dtype", "auto")
    dtype = mc.dtype if cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    mla = _uses_mla(vllm_config)  # a latent as two halves (kvcore_vllm.layout)
    one_head = mla or _per_head(vllm_config)
    return kvcore.CacheLayout(
        num_layers=mc.get_num_layers(pc),
        num_heads=1 if one_head else mc.get_num_kv_heads(pc),
        block_size=cc.block_size,
        head_dim=mc.get_head_size() // 2 if mla else mc.get_head_size(),
        dtype=kv_dtype_name(dtype),
    )


def _uses_mla(vllm_config: Any) -> bool:
    return bool(getattr(vllm_config.model_config, "use_mla", False))


def _per_head(vllm_config: Any, settings: ConnectorSettings | None = None) -> bool:
    """Whether the engine's connector stores one object per KV head (not for MLA)."""
    if settings is None:
        from kvcore_vllm.config import load_settings

        transfer = getattr(vllm_config, "kv_transfer_config", None)
        extra = getattr(transfer, "kv_connector_extra_config", None)
        if not extra or "backend" not in extra:
            return False
        settings = load_settings(extra)
    return settings.object_layout == "per_head" and not _uses_mla(vllm_config)


def engine_slice_plan(vllm_config: Any) -> SlicePlan:
    """The engine's :data:`~kvcore_vllm.context.SlicePlan`, from its configs alone."""
    return slice_plan(vllm_config, _uses_mla(vllm_config), _per_head(vllm_config))


def hashed_request(
    vllm_config: Any,
    request_id: str,
    token_ids: Sequence[int],
    *,
    max_tokens: int = 1,
    **fields: Any,
) -> Any:
    """A vLLM ``Request`` whose ``block_hashes`` vLLM's own hasher computed, as the engine
    does (``fields``: ``cache_salt``, ``lora_request``, ``mm_features``, ``prompt_embeds``, any
    other ``Request`` argument)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(hash_algo(vllm_config))
    init_none_hash(hash_fn)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        block_hasher=get_request_block_hasher(vllm_config.cache_config.block_size, hash_fn),
        **fields,
    )


def prompt_block_hashes(
    vllm_config: Any, token_ids: Sequence[int], *, cache_salt: str | None = None
) -> list[bytes]:
    """vLLM's block hashes of a prompt, as the engine computes them, for tools that name what
    an engine stored."""
    request = hashed_request(vllm_config, "kvcore-keys", token_ids, cache_salt=cache_salt)
    return list(request.block_hashes)


def engine_block_keys(
    vllm_config: Any, token_ids: Sequence[int], *, cache_salt: str | None = None
) -> list[str]:
    """The keys a running engine's connector gives ``token_ids``' full blocks."""
    from kvcore_vllm.config import load_settings

    settings = load_settings(vllm_config.kv_transfer_config.kv_connector_extra_config)
    layout = engine_layout(vllm_config)
    scoped = ScopedKeys(key_scope(vllm_config, settings, layout))
    return scoped.keys(prompt_block_hashes(vllm_config, token_ids, cache_salt=cache_salt))


def engine_object_names(
    vllm_config: Any, token_ids: Sequence[int], rank: int = 0
) -> list[tuple[str, ...]]:
    """``[block][part]`` names under which a running engine stores ``token_ids``' full blocks."""
    from kvcore_vllm.config import load_settings

    settings = load_settings(vllm_config.kv_transfer_config.kv_connector_extra_config)
    layout = engine_layout(vllm_config)
    keys = engine_block_keys(vllm_config, token_ids)
    names = kvcore.object_names(
        keys,
        layout.parts,
        namespace=settings.namespace,
        rank=rank,
        world_size=engine_slice_plan(vllm_config).world,
        weight_version=settings.weight_version,
    )
    return [tuple(n) for n in names]


# -- the secondary tier's chunk keys ---------------------------------------------------------


def tier_engine_config() -> Any | None:
    """The engine's ``VllmConfig`` where a secondary tier is built, or None.

    vLLM hands a secondary tier its offloading spec, which names the model and the chunk's
    format but not the model's settings. The config is vLLM's current config where one is set;
    vLLM 0.32 builds the scheduler's tiers without one, inside the ``OffloadingConnector``
    that holds it as ``vllm_config``: the frames that called the tier's constructor have it.
    """
    import inspect

    from vllm.config import VllmConfig, get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is not None:
        return config
    frame = inspect.currentframe()
    try:
        for _ in range(24):
            if frame is None:
                return None
            candidate = frame.f_locals.get("vllm_config")
            if isinstance(candidate, VllmConfig):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


def chunk_scope(
    offloading_spec: Any, settings: TierSettings, chunk_bytes: int, vllm_config: Any = None
) -> kvcore.KeyScope:
    """What must match for two engines to share a chunk of vLLM's CPU primary tier: the model
    and its settings (:func:`model_settings`), vLLM's own description of the chunk's format
    (the fields vLLM's ``fs`` tier names its directory by: dtype, tokens per hash, blocks per
    chunk, KV cache groups, parallel layout unless the layout is parallelism-agnostic,
    canonical format), the chunk's bytes, vLLM's release, the namespace and the weight version.

    Without the engine's config (``vllm_config`` None) the model's settings are unknown: the
    scope is then this process's alone, so chunks are shared by no other process rather than
    with an engine whose settings may differ.
    """
    import vllm
    from vllm.v1.kv_offload.file_mapper import FileMapper

    mapper = FileMapper.from_offloading_spec(
        root_dir="",
        offloading_spec=offloading_spec,
        blocks_per_file=offloading_spec.blocks_per_chunk,
        parallel_agnostic=True,
    )
    fields = mapper.get_run_config()
    extra = {k: json.dumps(v, sort_keys=True) for k, v in fields.items()}
    extra["chunk_bytes"] = str(chunk_bytes)
    extra["engine"] = "vllm-" + ".".join(str(vllm.__version__).split(".")[:2])
    extra["object_format"] = "tier-chunk-2"
    if vllm_config is not None:
        extra.update({f"model.{k}": v for k, v in model_settings(vllm_config).items()})
    else:
        extra["model.settings"] = THIS_PROCESS_ONLY
    model = (
        model_identity(vllm_config, settings)
        if vllm_config is not None
        else settings.model_id or str(fields.get("model_name", ""))
    )
    return kvcore.KeyScope(
        model=model,
        namespace=settings.namespace,
        weight_version=settings.weight_version,
        extra=extra,
    )


class ChunkKeys(ScopedKeys):
    """vLLM's chunk keys (``OffloadKey``: block hash and group) as kvcore block keys, and back
    (:class:`kvcore.keys.ScopedKeys`): an object name read from an event gives its chunk key
    back, other processes' stores and evictions included, with no table to keep."""

    __slots__ = ()

    def offload_key(self, identity: ObjectName | None) -> bytes | None:
        """The chunk key of the object of ``identity`` (an event's
        :attr:`~kvcore.events.StoreEvent.objects`); None for objects of another scope."""
        return None if identity is None else self.digest(identity.block_key)
