"""Settings of the Mooncake backend, and the FastDeploy settings it honours.

Precedence, lowest first: field defaults < the config given to ``open_backend`` < the
FastDeploy JSON file (``MOONCAKE_CONFIG_PATH`` or ``config_path``) and FastDeploy's
``MOONCAKE_*`` variables < ``KVCORE_MOONCAKE_<FIELD>`` variables. Environment beats the
given config as everywhere in kvcore: an operator's knob wins over a baked-in file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from kvcore import BackendConfig, ByteSize, ConfigError
from kvcore.schemas import MAX_TIMEOUT_S, interval_field, timeout_field

__all__ = ["FASTDEPLOY_ENV", "MIN_LOCAL_BUFFER", "MooncakeConfig"]

#: FastDeploy's environment variables (mooncake_store.py) and the field each one sets.
FASTDEPLOY_ENV = {
    "LOCAL_HOSTNAME": "local_hostname",
    "MOONCAKE_LOCAL_HOSTNAME": "local_hostname",
    "MOONCAKE_TE_META_DATA_SERVER": "metadata_server",
    "MOONCAKE_MASTER": "master_server_address",
    "MOONCAKE_PROTOCOL": "protocol",
    "MOONCAKE_DEVICE": "rdma_devices",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size",
    "MOONCAKE_LOCAL_BUFFER_SIZE": "local_buffer_size",
}
#: Keys of FastDeploy's JSON file whose name differs from ours.
_FILE_ALIASES = {"device_name": "rdma_devices", "master_server_addr": "master_server_address"}

#: Mooncake refuses a local copy buffer smaller than this (other than none at all).
MIN_LOCAL_BUFFER = 16 << 20


class MooncakeConfig(BackendConfig):
    """How to reach a Mooncake Store cluster and what this client contributes to it."""

    env_prefix = "KVCORE_MOONCAKE_"

    master_server_address: str = Field(
        description="host:port of mooncake_master's RPC service (FastDeploy: MOONCAKE_MASTER)"
    )
    local_hostname: str = Field(
        default="127.0.0.1",
        description="address other clients reach this one at; set the host's own IP on "
        "multi-node deployments",
    )
    metadata_server: str = Field(
        default="P2PHANDSHAKE",
        description="transfer-engine metadata: P2PHANDSHAKE (no extra service) or etcd://...",
    )
    protocol: Literal["tcp", "rdma"] = "tcp"
    rdma_devices: str | list[str] = Field(
        default="",
        description="NICs for rdma: 'mlx5_0,mlx5_1' for every rank, 'auto' to let Mooncake "
        "discover them, or a list with one entry per local device (picked by device_id)",
    )
    global_segment_size: ByteSize = Field(
        default=ByteSize(4 << 30),
        ge=0,
        description="bytes this client contributes to the store: an int, or a string such as "
        "'4GiB' (binary) or '4GB' (decimal, 10**9)",
    )
    local_buffer_size: ByteSize = Field(
        default=ByteSize(128 << 20),
        ge=0,
        description=f"bytes of Mooncake's own copy buffer: 0, or at least {MIN_LOCAL_BUFFER} "
        "(16MiB)",
    )
    master_metrics_port: int | None = Field(
        default=9003,
        ge=1,
        le=65535,
        description="port of the master's HTTP service (--metrics_port): the start-up "
        "/health check, and the key listing that lets the backend list the store and follow "
        "other clients' changes (None: neither)",
    )
    connect_timeout_s: float = timeout_field(
        2.0, "how long the start-up reachability checks may take"
    )
    rpc_timeout_ms: int = Field(
        default=3000,
        gt=0,
        le=int(MAX_TIMEOUT_S * 1000),
        description="bound on one master RPC (sets MC_RPC_TIMEOUT_MS unless already set)",
    )
    max_batch_bytes: ByteSize = Field(
        default=ByteSize(256 << 20),
        gt=0,
        description="reads and writes are issued in chunks of about this size; the deadline "
        "is checked between chunks",
    )
    replica_num: int = Field(default=1, ge=1, description="copies of each object")
    key_scheme: Literal["namespaced", "as_is"] = Field(
        default="namespaced",
        description="namespaced: every key under its namespace's prefix (clear removes exactly "
        "one namespace); as_is: a plain object name is the key itself, so another client that "
        "names keys the same way (FastDeploy's MooncakeStore) reads and writes the same "
        "objects; clear then has no namespace to remove and says so",
    )
    force_remove: bool = Field(
        default=True,
        description="remove and clear skip Mooncake's read leases, so a removal always takes "
        "effect; a client in the middle of reading a removed object may then get bytes of an "
        "object stored in its place. false: objects read or looked up in the last lease "
        "period (~10 s) stay, and remove reports them as a failure",
    )
    watch_interval_s: float = interval_field(
        0.5,
        "while the backend's events are followed, how often it lists the store to find what "
        "other clients stored and what left it (needs master_metrics_port); a large store is "
        "listed less often, so that listing takes at most a fifth of the time",
    )
    close_timeout_s: float = interval_field(
        5.0,
        "how long close() waits for Mooncake's client to shut down before leaving it to "
        "finish in the background",
    )
    config_path: str | None = Field(
        default=None, description="FastDeploy's Mooncake JSON file (MOONCAKE_CONFIG_PATH)"
    )

    @field_validator("local_buffer_size")
    @classmethod
    def _local_buffer(cls, value: ByteSize) -> ByteSize:
        if 0 < value < MIN_LOCAL_BUFFER:
            raise ValueError(
                f"{value} bytes: Mooncake needs 0 or at least {MIN_LOCAL_BUFFER} (16MiB; note "
                "'16MB' is 16,000,000)"
            )
        return value

    @field_validator("protocol", mode="before")
    @classmethod
    def _protocol(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("master_server_address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{value!r} must be host:port")
        return value.strip()

    @field_validator("rdma_devices")
    @classmethod
    def _devices(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("give at least one entry, or '' for none")
        return value

    # -- where the master is ---------------------------------------------------------------

    @property
    def master_host(self) -> str:
        return self.master_server_address.rpartition(":")[0].strip("[]")

    @property
    def master_port(self) -> int:
        return int(self.master_server_address.rpartition(":")[2])

    def health_url(self) -> str | None:
        return self.master_url("/health")

    def master_url(self, path: str) -> str | None:
        """The URL of ``path`` on the master's HTTP service (None: no port configured)."""
        if self.master_metrics_port is None:
            return None
        host = self.master_host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.master_metrics_port}{path}"

    def device_entry(self, device_id: int) -> str:
        """This rank's entry of ``rdma_devices`` (a list is indexed by the local device id)."""
        chosen = self.rdma_devices
        return chosen[device_id % len(chosen)] if isinstance(chosen, list) else chosen

    def devices_for(self, device_id: int) -> str:
        """The NIC list this rank passes to Mooncake ('' for tcp, and for 'auto')."""
        if self.protocol != "rdma":
            return ""
        chosen = self.device_entry(device_id)
        return "" if chosen == "auto" else chosen

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def env_overrides(cls, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        environ = os.environ if environ is None else environ
        found = fastdeploy_settings(environ)
        found.update(super().env_overrides(environ))
        return found

    @classmethod
    def load(cls, config: Any = None, environ: Mapping[str, str] | None = None) -> MooncakeConfig:
        data = config.model_dump(exclude_unset=True) if hasattr(config, "model_dump") else config
        data = dict(data or {})
        environ = os.environ if environ is None else environ
        # a config_path given in the config is read like MOONCAKE_CONFIG_PATH
        if data.get("config_path") and "MOONCAKE_CONFIG_PATH" not in environ:
            environ = {**environ, "MOONCAKE_CONFIG_PATH": str(data["config_path"])}
        return super().load(data, environ)


def fastdeploy_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """Fields set by FastDeploy's JSON file and ``MOONCAKE_*`` variables (variables win)."""
    found: dict[str, Any] = {}
    path = environ.get("MOONCAKE_CONFIG_PATH")
    if path:
        found.update(_read_file(Path(path)))
    for var, name in FASTDEPLOY_ENV.items():
        if environ.get(var):
            found[name] = environ[var]
    return found


def _read_file(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"MOONCAKE_CONFIG_PATH: cannot read {str(path)!r}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"MOONCAKE_CONFIG_PATH: {str(path)!r} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"MOONCAKE_CONFIG_PATH: {str(path)!r} must hold a JSON object")
    fields: dict[str, Any] = raw  # a JSON object: its keys are strings
    return {_FILE_ALIASES.get(k, k): v for k, v in fields.items() if v is not None}
