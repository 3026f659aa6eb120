"""The connector's settings: vLLM's ``kv_connector_extra_config``, validated once.

Every field is checked by pydantic and unknown keys are refused, so a typo in an operator's
``--kv-transfer-config`` line fails at start-up with the key named instead of being ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["ConnectorSettings", "SettingsError", "load_settings"]

#: Where the settings come from, for error messages.
SOURCE = "kv_transfer_config.kv_connector_extra_config"


class SettingsError(ValueError):
    """The connector's extra config is invalid; the message names every bad key."""


class ConnectorSettings(BaseModel):
    """What ``kv_connector_extra_config`` may hold (only ``backend`` is required)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(min_length=1, description="kvcore backend name: file, mooncake, ...")
    backend_config: dict[str, Any] = Field(
        default_factory=dict, description="the backend's own config (see its README)"
    )
    namespace: str = Field(
        default="default",
        min_length=1,
        description="user scope: engines share blocks only within one namespace",
    )
    model_id: str | None = Field(
        default=None,
        min_length=1,
        description="model identity in every key (default: vLLM's model name or path, plus "
        "its revision); set it when the same weights are served from different paths",
    )
    weight_version: str = Field(
        default="", description="ends every object name; bump it when the weights change"
    )
    load_timeout_s: float = Field(
        default=10.0, gt=0, description="a load that has not finished by then is recomputed"
    )
    save_timeout_s: float = Field(default=30.0, gt=0, description="deadline of one save task")
    lookup_timeout_s: float = Field(
        default=2.0, gt=0, description="scheduler-side existence check (it blocks scheduling)"
    )
    lookup_backoff_s: float = Field(
        default=10.0,
        ge=0,
        description="after a failed or slow lookup, lookups are skipped (misses) this long",
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
    reopen_interval_s: float = Field(
        default=30.0,
        ge=0,
        description="a backend that failed to open is tried again after this long (0: never)",
    )
    transfer: dict[str, Any] = Field(
        default_factory=dict,
        description="overrides of kvcore's TransferConfig (write_workers, staging_buffers, ...)",
    )


def load_settings(extra: dict[str, Any] | None) -> ConnectorSettings:
    """Validate vLLM's extra config; raise :class:`SettingsError` naming each bad key."""
    try:
        return ConnectorSettings.model_validate(dict(extra or {}))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(root)"
            problems.append(f"  {SOURCE}.{where}: {err['msg']}")
        raise SettingsError("invalid KVCoreConnector config:\n" + "\n".join(problems)) from None
