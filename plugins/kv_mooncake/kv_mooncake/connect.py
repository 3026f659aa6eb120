"""Start a Mooncake Store client: process environment, a fast master check, then setup.

Mooncake's own setup retries for about 90 seconds when the master is down. We ask the
master's ``/health`` endpoint and its RPC port first, so a wrong address fails in about a
second with a message that names it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import urllib.error
import urllib.request
from typing import Any

from kv_mooncake.codes import reason
from kv_mooncake.config import MIN_LOCAL_BUFFER, MooncakeConfig

__all__ = [
    "MasterUnreachableError",
    "MooncakeSetupError",
    "check_master",
    "http_get",
    "open_store",
    "prepare_environment",
]

log = logging.getLogger("kvcore.mooncake")

_INSTALL_HINT = (
    "install the plugin's dependencies (pip install kvcore-mooncake; on GPU hosts "
    "pip install 'kvcore-mooncake[cuda]') and the system library libibverbs1 "
    "(plugins/kv_mooncake/scripts/ensure_system_deps.sh does it as root)"
)


class MasterUnreachableError(ConnectionError):
    """The configured mooncake_master does not answer; raised by the backend's constructor."""


class MooncakeSetupError(RuntimeError):
    """The master answered but Mooncake's client setup failed."""


def prepare_environment(config: MooncakeConfig, device_id: int = 0) -> float:
    """Set Mooncake's process-wide variables unless the operator already did.

    Returns the master RPC timeout in seconds that Mooncake will use (it bounds every call).
    """
    env = os.environ
    env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")  # we check the master ourselves
    env.setdefault("MC_RPC_TIMEOUT_MS", str(config.rpc_timeout_ms))
    env.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)
    if config.protocol == "rdma" and config.device_entry(device_id) == "auto":
        env.setdefault("MC_MS_AUTO_DISC", "1")  # 'auto': let Mooncake pick the NICs
    try:
        return max(int(env["MC_RPC_TIMEOUT_MS"]), 1) / 1000
    except ValueError:
        return config.rpc_timeout_ms / 1000


def http_get(url: str, timeout: float) -> bytes:
    """GET ``url`` from the master's HTTP service (its health, its key listing)."""
    # No proxies: an http_proxy variable must not route a loopback request elsewhere.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as response:
        return response.read()


def check_master(config: MooncakeConfig) -> None:
    """Raise :class:`MasterUnreachableError` unless the master answers, within the timeout."""
    address = config.master_server_address
    timeout = config.connect_timeout_s
    url = config.health_url()
    health_problem = None
    if url is not None:
        try:
            body = json.loads(http_get(url, timeout) or b"{}")
        except (OSError, ValueError) as exc:
            health_problem = f"{url} did not answer ({_why(exc)})"
        else:
            if isinstance(body, dict) and body.get("service_ready") is False:
                raise MasterUnreachableError(
                    f"mooncake master {address} is up but not ready ({url} says "
                    f"service_ready=false); retry once it has started"
                )
    try:
        with socket.create_connection((config.master_host, config.master_port), timeout):
            pass
    except OSError as exc:
        extra = f"; {health_problem}" if health_problem else ""
        raise MasterUnreachableError(
            f"mooncake master at {address} is unreachable ({_why(exc)}){extra}. Start "
            "mooncake_master there or fix master_server_address (FastDeploy: MOONCAKE_MASTER)"
        ) from None
    if health_problem:
        log.warning(
            "mooncake master %s accepts connections but %s; check master_metrics_port",
            address,
            health_problem,
        )


def _why(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        exc = exc.reason
    return str(exc) or type(exc).__name__


def import_store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(f"cannot import mooncake.store ({exc}); {_INSTALL_HINT}") from exc
    return MooncakeDistributedStore


def open_store(config: MooncakeConfig, device_id: int, lookups_only: bool = False) -> Any:
    """A set-up ``MooncakeDistributedStore`` for this rank, or a clear exception.

    ``lookups_only``: a client that asks which keys exist and what blocks say of themselves
    (an engine's scheduler) contributes no memory segment to the store; Mooncake answers its
    ``batch_is_exist`` from the master alone, and its small copy buffer (the least Mooncake
    takes, or none when ``local_buffer_size`` is 0) receives block metadata.
    """
    store_class = import_store_class()
    check_master(config)
    store = store_class()
    code = store.setup(
        config.local_hostname,
        config.metadata_server,
        0 if lookups_only else config.global_segment_size,
        min(config.local_buffer_size, MIN_LOCAL_BUFFER)
        if lookups_only
        else config.local_buffer_size,
        config.protocol,
        config.devices_for(device_id),
        config.master_server_address,
    )
    if code != 0:
        raise MooncakeSetupError(
            f"Mooncake client setup against {config.master_server_address} failed with code "
            f"{code} ({reason(code)}); check local_hostname={config.local_hostname!r}, "
            f"protocol={config.protocol!r} and the master's log"
        )
    return store
