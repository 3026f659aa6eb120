"""The connector's settings: vLLM's ``kv_connector_extra_config``, validated once.

Every field is checked by pydantic and unknown keys are refused, so a typo in an operator's
``--kv-transfer-config`` line fails at start-up with the key named instead of being ignored.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator

from kvcore.config import EngineBackendSettings
from kvcore.schemas import interval_field, timeout_field

_Settings = TypeVar("_Settings", bound=BaseModel)

__all__ = [
    "ConnectorSettings",
    "SettingsError",
    "TierSettings",
    "load_settings",
    "load_tier_settings",
]

#: Where the settings come from, for error messages.
SOURCE = "kv_transfer_config.kv_connector_extra_config"


class SettingsError(ValueError):
    """The connector's extra config is invalid; the message names every bad key."""


class _StoreSettings(EngineBackendSettings):
    """What the connector and the tier both take: the backend (``backend``, required,
    ``backend_config``, ``reopen_interval_s``) and the scope of its names (``namespace``,
    default ``default``, and the weight version), on kvcore's base for every engine's."""

    weight_version: str = Field(
        default="", description="ends every object name; bump it when the weights change"
    )


def _validated(
    model: type[_Settings], settings: dict[str, Any], source: str, what: str
) -> _Settings:
    """``settings`` as ``model``; :class:`SettingsError` naming every bad key under ``source``."""
    try:
        return model.model_validate(dict(settings))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(root)"
            problems.append(f"  {source}.{where}: {err['msg']}")
        raise SettingsError(f"invalid {what} config:\n" + "\n".join(problems)) from None


class ConnectorSettings(_StoreSettings):
    """What ``kv_connector_extra_config`` may hold (only ``backend`` is required)."""

    model_id: str | None = Field(
        default=None,
        min_length=1,
        description="model identity in every key (default: vLLM's model name or path, plus "
        "its revision); set it when the same weights are served from different paths",
    )
    load_timeout_s: float = timeout_field(
        10.0, "a load that has not finished by then is recomputed"
    )
    save_timeout_s: float = timeout_field(30.0, "deadline of one save task")
    lookup_timeout_s: float = timeout_field(
        2.0, "scheduler-side existence check (it blocks scheduling)"
    )
    lookup_backoff_s: float = interval_field(
        10.0, "after a failed or slow lookup, lookups are skipped (misses) this long"
    )
    object_layout: Literal["per_rank", "per_head"] = Field(
        default="per_rank",
        description="per_rank: one object per part per block per rank, read only by engines of "
        "the same TP degree; per_head: one per part per block per KV head, so engines of any "
        "TP degree share blocks (more, smaller objects: docs/vllm.md)",
    )
    load_mode: Literal["auto", "async", "sync"] = Field(
        default="auto",
        description="async: a restoring request waits for its blocks outside the batch "
        "(vLLM's WAITING_FOR_REMOTE_KVS) and a failed load recomputes the request; sync: "
        "blocks load inside the step that uses them, a failed block is recomputed alone; "
        "auto: async for hybrid models (vLLM recovers their failed loads only that way, and a "
        "Mamba state must be in place before vLLM's step copies it), else sync",
    )
    save_decode_blocks: bool = Field(
        default=True,
        description="also store blocks filled by generated tokens (multi-turn chats reuse them)",
    )
    load_failure_policy: Literal["recompute", "fail"] = Field(
        default="recompute",
        description="what vLLM does with blocks that failed to load: recompute them (a cache "
        "tier's failure is a miss) or fail the request",
    )
    transfer: dict[str, Any] = Field(
        default_factory=dict,
        description="overrides of kvcore's TransferConfig (write_workers, staging_buffers, ...)",
    )
    prefill_profile: str = Field(
        default="auto",
        min_length=1,
        description="load_policy auto: where this engine's timed prefill steps are kept for the "
        "next engine of the same model and settings on this machine, whose first decisions "
        "then start from them (kvcore.prefill_profile): auto ($KVCORE_PREFILL_PROFILE, else "
        "$XDG_CACHE_HOME/kvcore-prefill), a directory, or off",
    )
    events_interval_s: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="with kv_events_config: the store's events (other processes' blocks, "
        "evictions, clears) are published this often at most after they happen, whether or not "
        "the engine steps (backends that report the whole store: kv_file)",
    )


def load_settings(extra: dict[str, Any] | None) -> ConnectorSettings:
    """Validate vLLM's extra config; raise :class:`SettingsError` naming each bad key."""
    return _validated(ConnectorSettings, extra or {}, SOURCE, "KVCoreConnector")


#: Where the tier's settings come from, for error messages.
TIER_SOURCE = "kv_connector_extra_config.secondary_tiers[type=kvcore]"


class TierSettings(_StoreSettings):
    """One kvcore entry of ``secondary_tiers`` (``type`` and ``module_path`` are vLLM's;
    only ``backend`` is required)."""

    model_id: str | None = Field(
        default=None,
        min_length=1,
        description="model identity in every key (default: vLLM's model name); set it when the "
        "same weights are served under different names",
    )
    load_timeout_s: float = timeout_field(
        10.0, "a promotion job not finished by then fails (its chunks are recomputed)"
    )
    store_timeout_s: float = timeout_field(30.0, "deadline of one store job")
    lookup_timeout_s: float = timeout_field(
        2.0, "deadline of one batched existence check (run off the scheduler's thread)"
    )
    load_workers: int = Field(default=2, ge=1, le=64, description="promotion jobs run at once")
    store_workers: int = Field(default=2, ge=1, le=64, description="store jobs run at once")
    max_queued_stores: int = Field(
        default=256,
        ge=1,
        description="store jobs waiting for a worker; past it a store is dropped (a future "
        "miss, counted), so a slow backend never holds the primary tier's chunks",
    )
    enable_kv_events: bool = Field(
        default=False,
        description="publish BlockStored/BlockRemoved for what the store gains and loses "
        "(needs vLLM's kv_events_config); evictions and other processes' changes included "
        "where the backend reports them",
    )
    locality: str | None = Field(
        default=None, description="LOCAL or REMOTE: where the store is relative to this engine"
    )

    @field_validator("locality")
    @classmethod
    def _locality(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from vllm.v1.kv_offload.base import Locality  # vLLM's own names and error

        return Locality(value).value


def load_tier_settings(settings: dict[str, Any]) -> TierSettings:
    """Validate a kvcore tier's settings; raise :class:`SettingsError` naming each bad key."""
    return _validated(TierSettings, settings, TIER_SOURCE, "kvcore secondary tier")
