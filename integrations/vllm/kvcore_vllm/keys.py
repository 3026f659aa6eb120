"""Block keys: kvcore's chained SHA-256 prefix hashes over token ids, scoped to this engine.

vLLM's own block hashes are not used: their seed is random per process unless
``PYTHONHASHSEED`` is set, and they do not name the model or the cache's physical form. A key
here commits to every token before the block's end and to the scope below, so the same prompt
maps to the same keys in any process on any machine, and only engines whose blocks are
byte-compatible share them. TP rank and world size are not in the key: kvcore puts them in
every object name (each rank stores its own slice of the heads).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import kvcore
from kvcore.keys import parse_object_name, root_hash
from kvcore_vllm.config import ConnectorSettings, TierSettings
from kvcore_vllm.context import engine_world

__all__ = [
    "ChunkKeys",
    "KeyChain",
    "chunk_scope",
    "engine_layout",
    "engine_object_names",
    "key_scope",
    "model_identity",
]


def model_identity(vllm_config: Any, settings: ConnectorSettings) -> str:
    """The configured ``model_id``, else vLLM's model name or path plus its revision."""
    if settings.model_id:
        return settings.model_id
    model_config = vllm_config.model_config
    revision = getattr(model_config, "revision", None) or ""
    return f"{model_config.model}@{revision}" if revision else str(model_config.model)


def key_scope(
    vllm_config: Any, settings: ConnectorSettings, layout: kvcore.CacheLayout
) -> kvcore.KeyScope:
    """Everything besides the tokens that must match for two engines to share a block."""
    import vllm
    from vllm.platforms import current_platform

    major_minor = ".".join(str(vllm.__version__).split(".")[:2])
    attention = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    cache = vllm_config.cache_config
    extra = {
        # the physical block format: vLLM release, device type and attention backend decide
        # how K and V sit inside a block, so objects are only shared when they agree
        "engine": f"vllm-{major_minor}",
        "device": str(current_platform.device_type),
        "attention": str(attention or "auto"),
        "kv_dtype": layout.dtype.value,
        "cache_dtype": str(getattr(cache, "cache_dtype", "auto")),
        "block_size": str(layout.block_size),
        "kv_heads": str(layout.num_heads),
        "head_dim": str(layout.head_dim),
        "layers": str(layout.num_layers),
        # what an object holds: 2 = a block's halves of the layer list where K and V share a
        # block (1, before: halves of each layer's block); another format never matches
        "object_format": "2",
    }
    return kvcore.KeyScope(
        model=model_identity(vllm_config, settings), namespace=settings.namespace, extra=extra
    )


class KeyChain:
    """The keys of one sequence's full blocks, extended as tokens arrive (never recomputed)."""

    __slots__ = ("block_size", "keys", "scope")

    def __init__(self, scope: kvcore.KeyScope, block_size: int) -> None:
        self.scope = scope
        self.block_size = block_size
        self.keys: list[str] = []

    def upto(self, token_ids: Sequence[int], num_blocks: int) -> list[str]:
        """Keys of blocks ``0 .. num_blocks - 1`` (``token_ids`` must cover them)."""
        have = len(self.keys)
        if num_blocks > have:
            bs = self.block_size
            if len(token_ids) < num_blocks * bs:
                raise ValueError(
                    f"token_ids has {len(token_ids)} tokens; {num_blocks} blocks need "
                    f"{num_blocks * bs}"
                )
            tail = list(token_ids[have * bs : num_blocks * bs])
            parent = self.keys[-1] if self.keys else None
            self.keys.extend(kvcore.block_hashes(tail, bs, self.scope, parent=parent))
        return self.keys[:num_blocks]

    def truncate(self, num_blocks: int) -> None:
        """Forget keys past ``num_blocks`` (tokens there may change, e.g. after preemption)."""
        del self.keys[num_blocks:]


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
    return kvcore.CacheLayout(
        num_layers=mc.get_num_layers(pc),
        num_heads=mc.get_num_kv_heads(pc),
        block_size=cc.block_size,
        head_dim=mc.get_head_size(),
        dtype=kv_dtype_name(dtype),
    )


def engine_block_keys(vllm_config: Any, token_ids: Sequence[int]) -> list[str]:
    """The keys a running engine's connector gives ``token_ids``' full blocks."""
    from kvcore_vllm.config import load_settings

    settings = load_settings(vllm_config.kv_transfer_config.kv_connector_extra_config)
    layout = engine_layout(vllm_config)
    chain = KeyChain(key_scope(vllm_config, settings, layout), layout.block_size)
    return chain.upto(token_ids, len(token_ids) // layout.block_size)


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
        world_size=engine_world(vllm_config),
        weight_version=settings.weight_version,
    )
    return [tuple(n) for n in names]


# -- the secondary tier's chunk keys ---------------------------------------------------------


def chunk_scope(offloading_spec: Any, settings: TierSettings, chunk_bytes: int) -> kvcore.KeyScope:
    """What must match for two engines to share a chunk of vLLM's CPU primary tier: the model,
    vLLM's own description of the chunk's format (the fields vLLM's ``fs`` tier names its
    directory by: dtype, tokens per hash, blocks per chunk, KV cache groups, parallel layout
    unless the layout is parallelism-agnostic, canonical format), the chunk's bytes, vLLM's
    release, the namespace and the weight version."""
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
    extra["object_format"] = "tier-chunk-1"
    return kvcore.KeyScope(
        model=settings.model_id or str(fields.get("model_name", "")),
        namespace=settings.namespace,
        weight_version=settings.weight_version,
        extra=extra,
    )


class ChunkKeys:
    """vLLM's chunk keys (``OffloadKey``: block hash and group) as kvcore block keys, and back.

    A block key is the scope's digest (128 bits, hex) followed by the chunk key in hex: two
    scopes never share a key, one scope always maps a chunk to the same key in every process,
    and an object name read from an event gives its chunk key back (other processes' stores
    and evictions included), with no table to keep.
    """

    __slots__ = ("prefix",)

    def __init__(self, scope: kvcore.KeyScope) -> None:
        self.prefix = root_hash(scope).hex()[:32]

    def key(self, offload_key: bytes) -> str:
        return self.prefix + offload_key.hex()

    def offload_key(self, name: str) -> bytes | None:
        """The chunk key of object ``name``; None for objects of another scope."""
        parsed = parse_object_name(name)
        if parsed is None or not parsed.block_key.startswith(self.prefix):
            return None
        try:
            return bytes.fromhex(parsed.block_key[len(self.prefix) :])
        except ValueError:
            return None
