"""Settings of a tier stack; every field can be overridden with ``KVCORE_TIERED_<FIELD>``
(``KVCORE_TIERED_TIERS`` as a JSON list)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

import kvcore
from kvcore.schemas import timeout_field

__all__ = ["TierSpec", "TieredConfig"]


class TierSpec(BaseModel):
    """One tier: an installed backend's name and its config.

    Written either as ``{"backend": "file", "config": {"root": "/nvme/kv"}}`` or with the
    config's keys beside the name, ``{"backend": "file", "root": "/nvme/kv"}``.
    """

    model_config = ConfigDict(extra="forbid")

    backend: str = Field(min_length=1, description="an installed kvcore backend's name")
    config: dict[str, Any] = Field(default_factory=dict, description="that backend's config")

    @model_validator(mode="before")
    @classmethod
    def _inline_config(cls, value: Any) -> Any:
        if isinstance(value, dict) and "config" not in value:
            rest = {k: v for k, v in value.items() if k != "backend"}
            return {"backend": value.get("backend"), "config": rest}
        return value


class TieredConfig(kvcore.BackendConfig):
    env_prefix = "KVCORE_TIERED_"

    tiers: list[TierSpec] = Field(
        min_length=1,
        description="the tiers, fastest first: reads are served by the first tier holding a "
        "block, writes are acknowledged by the first tier that stores them",
    )
    write_policy: Literal["write-through", "write-back-on-evict"] = Field(
        default="write-through",
        description="write-through: a write is acknowledged when the first tier has it; the "
        "tiers below receive it asynchronously (bounded backlog, drops counted). "
        "write-back-on-evict: a tier below receives only what the tier above it evicts "
        "(handed over by that tier before the bytes are deleted: kvcore_evict_to)",
    )
    promote: bool = Field(
        default=True,
        description="copy blocks read from a lower tier into the tiers above it, in the "
        "background, before the read's deadline",
    )
    backlog_blocks: int = Field(
        default=4096,
        ge=1,
        description="blocks queued for background copies (promotions and write-through) "
        "before further ones are dropped and counted",
    )
    mover_threads: int = Field(default=1, ge=1, le=16, description="background copy threads")
    copy_yield_s: float = Field(
        default=0.5,
        ge=0,
        le=60,
        description="seconds a background copy waits for the stack's reads and writes to "
        "pause before it runs beside them (never past its deadline; 0: it never waits)",
    )
    lower_timeout_s: float = timeout_field(
        30.0,
        "seconds a background write-through copy may take (promotions keep the read's deadline)",
    )

    @model_validator(mode="after")
    def _tiers_are_distinct_and_installed(self) -> TieredConfig:
        """Every tier names an installed backend with a valid config (errors name
        ``tiers[i]``), no two tiers share a root (one directory would hold both tiers' objects
        and their capacity accounting), and the stack's environment variable does not reach a
        nested stack (it would apply to it too, and recurse)."""
        variable = self.env_variable("tiers")
        roots: dict[str, int] = {}
        for i, spec in enumerate(self.tiers):
            where = f"tiers[{i}] ({spec.backend})"
            if spec.backend == "tiered" and os.environ.get(variable):
                raise ValueError(
                    f"{where}: a nested stack while {variable} is set: the variable would "
                    "set the nested stack's tiers too; give the stacks their tiers in their "
                    "configs"
                )
            try:
                checked = kvcore.check_backend_config(spec.backend, spec.config)
            except kvcore.UnknownBackendError as exc:
                raise ValueError(f"{where}: {exc}") from None
            except kvcore.ConfigError as exc:
                raise ValueError(f"{where}: {exc}") from None
            root = getattr(checked, "root", None)
            if isinstance(root, str) and root:
                real = os.path.realpath(root)
                if real in roots:
                    raise ValueError(
                        f"{where}: root {root!r} is also tiers[{roots[real]}]'s: two tiers on "
                        "one root would share its objects and its capacity"
                    )
                roots[real] = i
        return self
