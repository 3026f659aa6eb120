"""What the adapter reads from LMCache's ``adapter_params`` (MP mode) or ``extra_config``
(the in-process plugin), validated strictly: a typo such as ``backend_confg`` is an error
naming the key, never a silently ignored setting.

Importing this module imports neither LMCache nor torch.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr, ValidationError

from kvcore.config import EngineBackendSettings
from kvcore.schemas import timeout_field

__all__ = ["AdapterSettings", "settings_error"]


class AdapterSettings(EngineBackendSettings):
    """The kvcore side of an LMCache storage adapter (``backend_config`` and
    ``reopen_interval_s`` as kvcore's base has them)."""

    backend: str = Field(
        default="file",
        description="kvcore backend name (an entry point of kvcore.backends: file, mooncake, "
        "tiered, memory, ...)",
    )
    namespace: str = Field(
        default="lmcache",
        description="leading part of every object's name: servers that should share objects "
        "use the same one (LMCache's key fields follow it)",
    )
    io_threads: int = Field(
        default=4,
        ge=1,
        le=64,
        description="threads running the adapter's store, lookup and load tasks (LMCache's "
        "calls never block on I/O)",
    )
    timeout_s: float | None = timeout_field(
        None, "deadline of each backend call (default: the backend's default_timeout_s)"
    )
    max_capacity_bytes: int = Field(
        default=0,
        ge=0,
        description="capacity LMCache's eviction policies see (0: unbounded, LMCache does not "
        "evict; the backend's own capacity still applies)",
    )
    verify_layout: bool = Field(
        default=True,
        description="store each object's layout (size, format, shapes, dtypes) with it and "
        "check it against the load buffer: same-size KV of another dtype is never loaded "
        "(backends that keep no block metadata: see docs/lmcache.md)",
    )
    chunk_tokens: int = Field(
        default=256,
        ge=1,
        description="tokens per stored object (LMCache's chunk_size), for the load-or-recompute "
        "decision of the L2 adapter's lookups (the storage plugin reads LMCache's metadata)",
    )
    seed_usage: bool = Field(
        default=True,
        description="at start, list the store and report what it holds to LMCache (usage, "
        "eviction order): a restarted server does not start from zero",
    )

    #: where these settings were read (``from_params``' ``where``): errors found later, in
    #: the backend's own config, name the key from there
    _where: str = PrivateAttr(default="kvcore adapter settings")

    @property
    def where(self) -> str:
        return self._where

    @classmethod
    def from_params(cls, params: dict[str, Any] | None, where: str) -> AdapterSettings:
        """Validated settings; :raises ValueError: naming ``where`` and each bad key."""
        try:
            settings = cls.model_validate(params or {})
        except ValidationError as exc:
            raise ValueError(settings_error(exc, where)) from None
        settings._where = where
        return settings


def settings_error(exc: ValidationError, where: str) -> str:
    """One line per bad key: ``where: key: what is wrong``."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"]) or "(settings)"
        lines.append(f"{where}: {key}: {err['msg']}")
    return "; ".join(lines)
