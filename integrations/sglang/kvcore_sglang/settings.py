"""The adapter's part of SGLang's ``--hicache-storage-backend-extra-config`` and the identity
(namespace, rank, world size, writer) it derives from ``HiCacheStorageConfig``.

SGLang hands every backend the whole extra config: its own loader keys (``backend_name``,
``module_path``, ``class_name``, ``interface_v1``) and knobs other layers pop or read
(``prefetch_threshold``, ``tp_lcm_size``, ...) sit beside ours. Ours are validated strictly, so
a typo such as ``backend_confg`` is an error naming the key instead of a silently ignored
setting; SGLang's are recognised by name and left alone.

Importing this module imports neither SGLang nor torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError

from kvcore.config import MAX_NAMESPACE_CHARS, EngineBackendSettings
from kvcore.keys import THIS_PROCESS_ONLY
from kvcore.schemas import timeout_field

__all__ = [
    "SGLANG_KEYS",
    "SGLANG_KEY_PREFIXES",
    "StorageIdentity",
    "StorageSettings",
    "model_settings",
    "safe_namespace",
]

log = logging.getLogger("kvcore_sglang.settings")

#: SGLang server arguments that change K/V values for the same model name (the model's path and
#: revision, dtypes, quantization, config overrides such as RoPE, how weights are loaded)
MODEL_SETTING_ARGS = (
    "model_path",
    "revision",
    "dtype",
    "kv_cache_dtype",
    "quantization",
    "quantization_param_path",
    "json_model_override_args",
    "load_format",
    "model_impl",
    "weight_version",
)


def model_settings() -> dict[str, str] | None:
    """The engine's K/V-changing settings (:data:`MODEL_SETTING_ARGS`) from the server
    arguments SGLang publishes in its scheduler process; None where none are published."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception:  # not published (a storage built outside SGLang's scheduler)
        return None
    return {name: str(getattr(args, name, None)) for name in MODEL_SETTING_ARGS}


def _identity_tag(model: str, settings: dict[str, str] | None) -> str:
    """A short digest of the model and its settings, ending every namespace: pages of
    another model, or of the same model with settings that change K/V, are never read."""
    if settings is None:
        log.warning(
            "kvcore storage: SGLang's server arguments are not published in this process, so "
            "the model's settings are unknown: pages are keyed for this process alone"
        )
        settings = {"settings": THIS_PROCESS_ONLY}
    text = json.dumps({"model": model, **settings}, sort_keys=True, separators=(",", ":"))
    return "m" + hashlib.sha256(text.encode()).hexdigest()[:16]


#: Keys of the extra config that belong to SGLang (its dynamic loader, and knobs its cache
#: controllers and built-in backends read), not to this adapter.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "allocator",
        "file_storage_path",
        "enable_metadata_cache",
        "metadata_ttl",
    }
)
#: Prefixes of SGLang's prefetch and storage knobs (``prefetch_threshold``,
#: ``prefetch_timeout_base``, ``hicache_storage_pass_prefix_keys``, ...).
SGLANG_KEY_PREFIXES = ("prefetch_", "hicache_")

_NAMESPACE_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
#: kvcore's namespace rule (kvcore.config.check_namespace): 1-128 characters of [A-Za-z0-9._-]
MAX_NAMESPACE = MAX_NAMESPACE_CHARS


def safe_namespace(text: str) -> str:
    """``text`` as a namespace every kvcore backend accepts (:func:`kvcore.config.check_namespace`;
    a namespace the operator gives is checked by it, this builds the derived ones).

    Runs of other characters become ``-`` (SGLang itself writes model ``a/b`` as ``a-b``); a
    leading ``.``/``-`` is dropped; an over-long result keeps its head and gains a short hash
    of the whole, so two long names that share a head stay apart.
    """
    cleaned = _NAMESPACE_CHARS.sub("-", text).lstrip(".-") or "sglang"
    if len(cleaned) <= MAX_NAMESPACE:
        return cleaned
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"{cleaned[: MAX_NAMESPACE - 13]}-{digest}"


class StorageSettings(EngineBackendSettings):
    """What the adapter reads from the extra config (every other key must be SGLang's);
    ``backend_config`` and ``reopen_interval_s`` as kvcore's base has them."""

    backend: str = Field(
        default="file",
        description="kvcore backend name (an entry point of kvcore.backends: file, mooncake, "
        "memory, attentionstore, ...)",
    )
    # None until StorageIdentity derives it from the model; one given is held to kvcore's
    # rule (the base's validator), the identity's suffixes are added to it
    namespace: str | None = Field(  # type: ignore[assignment]
        default=None,
        description="leading part of every object's namespace (default: 'sglang-<model>'); "
        "engines that should share pages must use the same one",
    )
    timeout_s: float | None = timeout_field(
        None, "deadline of each storage call (default: the backend's default_timeout_s)"
    )
    weight_version: str = Field(
        default="",
        max_length=64,
        pattern=r"^[A-Za-z0-9._-]*$",
        description="model-weight version ending every object name: pages computed with other "
        "weights are then never read",
    )
    events_endpoint: str | None = Field(
        default=None,
        description="publish the storage tier's KV events (SGLang's BlockStored/BlockRemoved/"
        "AllBlocksCleared, SGLang's ZMQ publisher) on this endpoint, e.g. "
        "'tcp://127.0.0.1:5560' (a collector binds it) or 'ipc:///run/kv-events' (bound "
        "here); SGLang 0.5.23 has no event path for its storage tier (default: none)",
    )
    events_medium: Literal["DISK", "EXTERNAL"] | None = Field(
        default=None,
        description="the medium the events name: DISK (a node's own store) or EXTERNAL (a "
        "store replicas share) (default: DISK for the file backend, else EXTERNAL)",
    )
    events_topic: str = Field(default="", description="ZMQ topic of the events")
    register_host_pool: bool = Field(
        default=True,
        description="announce the host pool's memory to the backend once (zero-copy "
        "transports such as Mooncake over RDMA need it)",
    )

    @classmethod
    def from_extra_config(cls, extra_config: dict[str, Any] | None) -> StorageSettings:
        """Validate the adapter's keys of ``extra_config``; errors name the offending key."""
        if extra_config is None:
            extra_config = {}
        if not isinstance(extra_config, dict):
            raise ValueError(
                f"hicache storage extra config must be a JSON object, got {type(extra_config).__name__}"
            )
        ours = {
            key: value
            for key, value in extra_config.items()
            if key not in SGLANG_KEYS and not key.startswith(SGLANG_KEY_PREFIXES)
        }
        try:
            return cls.model_validate(ours)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(config)'}: {err['msg']}"
                for err in exc.errors()
            )
            known = ", ".join(sorted(cls.model_fields))
            raise ValueError(
                f"hicache storage extra config for kvcore: {problems} (kvcore's keys: {known}; "
                "SGLang's own keys are passed through)"
            ) from None


@dataclass(frozen=True)
class StorageIdentity:
    """Which objects this rank reads and writes, derived from ``HiCacheStorageConfig``.

    - MHA: every TP rank holds its own slice of the heads, so the TP rank and size go into
      kvcore's context and name distinct objects per rank (a cache written with another TP
      degree is never read back).
    - MLA (one latent row per token, replicated across TP ranks): all TP ranks share one
      object per page; only the storage-writer rank writes it. With decode context
      parallelism each DCP shard is its own object (rank = DCP rank).
    - Pipeline stages hold different layers and attention-CP ranks disjoint slices of a page:
      both go into the namespace.
    - The model and every server argument that changes its K/V (:data:`MODEL_SETTING_ARGS`)
      end the namespace as a digest, also when the operator names the namespace.
    - TP-sharded side state (Mamba) is named per TP rank even for MLA models.
    """

    namespace: str
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    is_mla: bool
    is_writer: bool

    @classmethod
    def from_storage_config(cls, storage_config: Any, settings: StorageSettings) -> StorageIdentity:
        if getattr(storage_config, "should_split_heads", False):
            raise NotImplementedError(
                "kvcore storage does not split heads across heterogeneous TP degrees "
                "(tp_lcm_size with the page_head layout); run every engine with one TP size"
            )
        model = getattr(storage_config, "model_name", None) or ""
        base = settings.namespace or (f"sglang-{model}" if model else "sglang")
        suffix = ""
        pp_size = int(storage_config.pp_size)
        if pp_size > 1:
            suffix += f".pp{storage_config.pp_rank}of{pp_size}"
        cp_size = int(getattr(storage_config, "attn_cp_size", 1) or 1)
        if cp_size > 1:
            suffix += f".cp{storage_config.attn_cp_rank}of{cp_size}"
        is_mla = bool(storage_config.is_mla_model)
        if is_mla:
            rank = int(getattr(storage_config, "dcp_rank", 0) or 0)
            world = int(getattr(storage_config, "dcp_size", 1) or 1)
            if world > 1:
                # a DCP shard's bytes depend on the DCP degree and the logical page size
                suffix += f".page{storage_config.logical_page_size}"
            writer = bool(storage_config.is_storage_writer)
        else:
            rank, world, writer = int(storage_config.tp_rank), int(storage_config.tp_size), True
        # the model and its settings end the namespace whatever the operator named it: a
        # namespace shared by two models or two RoPE settings must not share pages
        suffix += "." + _identity_tag(model, model_settings())
        return cls(
            namespace=safe_namespace(safe_namespace(base) + suffix),
            rank=rank,
            world_size=world,
            tp_rank=int(storage_config.tp_rank),
            tp_size=int(storage_config.tp_size),
            is_mla=is_mla,
            is_writer=writer,
        )

    def kv_namespace(self, format_tag: str) -> str:
        """The namespace of the KV pages: the identity's plus the page format (see pages.py)."""
        return _join(self.namespace, format_tag)

    def side_namespace(self) -> str:
        """The namespace of the side pools' objects (v2 API)."""
        return _join(self.namespace, "side")


def _join(namespace: str, tail: str) -> str:
    return safe_namespace(f"{namespace}.{tail}")
