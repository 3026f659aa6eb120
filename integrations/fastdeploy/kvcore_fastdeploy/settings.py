"""``--kvcache-storage-backend kvcore:<name>`` and FastDeploy's environment, as kvcore settings.

A FastDeploy deployment that switches to a kvcore backend keeps its environment: the variables
its own stores read are mapped here onto the kvcore backend's config, with FastDeploy's
defaults, so the switch changes one argument and nothing else.

- ``kvcore:file``: ``FILE_BACKEND_STORAGE_DIR`` (FastDeploy's ``envs.py``, default
  ``/tmp/fastdeploy``) -> ``root``; FastDeploy's per-model subdirectory is kvcore's namespace.
- ``kvcore:mooncake``: what FastDeploy's ``MooncakeStoreConfig.create`` reads
  (``mooncake_store.py`` at PaddlePaddle/FastDeploy@ecce94cdc0dd2694826db98dcfb041aee8c5e499):
  ``MOONCAKE_CONFIG_PATH`` (a JSON file which, when set, replaces the variables, as in
  FastDeploy), else ``MOONCAKE_LOCAL_HOSTNAME``, ``MOONCAKE_METADATA_SERVER``,
  ``MOONCAKE_GLOBAL_SEGMENT_SIZE``, ``MOONCAKE_LOCAL_BUFFER_SIZE``, ``MOONCAKE_PROTOCOL``,
  ``MOONCAKE_RDMA_DEVICES``, ``MOONCAKE_MASTER_SERVER_ADDR``.
- ``kvcore:attentionstore`` is refused: FastDeploy drives AttentionStore through its own
  token-addressed ``attention_store`` branch; the kvcore backend of that name (which reads
  FastDeploy's ``AS_*`` variables itself) is for kvcore's TransferManager.

``KVCORE_FASTDEPLOY_BACKEND_CONFIG`` (inline JSON or a JSON file) adds or overrides backend
config fields for any backend; each backend's own ``KVCORE_<BACKEND>_<FIELD>`` variables still
win over everything, as everywhere in kvcore.

:class:`FastDeploySettings` gathers all of it (the argument, FastDeploy's model id, the
variables) into kvcore's settings of an engine's backend, validated once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationError

from kvcore.config import EngineBackendSettings
from kvcore.schemas import parse_config_arg

__all__ = [
    "BACKEND_PREFIX",
    "EXTRA_CONFIG_ENV",
    "FASTDEPLOY_FILE_ENV",
    "FASTDEPLOY_MOONCAKE_ENV",
    "REOPEN_ENV",
    "VERIFY_BLOCKS_ENV",
    "FastDeploySettings",
    "fastdeploy_backend_config",
    "parse_backend_spec",
    "reopen_interval_setting",
    "verify_blocks_setting",
]

BACKEND_PREFIX = "kvcore:"
EXTRA_CONFIG_ENV = "KVCORE_FASTDEPLOY_BACKEND_CONFIG"
#: ``auto`` (default): a backend without checksums (Mooncake, memory) keeps a digest beside
#: every object and refuses an object that has none or differs from it; ``never`` reads
#: objects as they are, for a fleet where FastDeploy's own stores write beside kvcore (their
#: objects carry no digest). See kvcore.integrity.
VERIFY_BLOCKS_ENV = "KVCORE_FASTDEPLOY_VERIFY_BLOCKS"

#: FastDeploy's file store directory and its default (envs.py at 1af00818)
FASTDEPLOY_FILE_ENV = ("FILE_BACKEND_STORAGE_DIR", "/tmp/fastdeploy")

#: FastDeploy's Mooncake variables -> kv_mooncake fields
FASTDEPLOY_MOONCAKE_ENV = {
    "MOONCAKE_LOCAL_HOSTNAME": "local_hostname",
    "MOONCAKE_METADATA_SERVER": "metadata_server",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size",
    "MOONCAKE_LOCAL_BUFFER_SIZE": "local_buffer_size",
    "MOONCAKE_PROTOCOL": "protocol",
    "MOONCAKE_RDMA_DEVICES": "rdma_devices",
    "MOONCAKE_MASTER_SERVER_ADDR": "master_server_address",
}
#: FastDeploy's defaults where they differ from kv_mooncake's (mooncake_store.py at ecce94cd:
#: 1 GiB segment, 128 MiB buffer, "localhost", rdma); the master and metadata server have none
_FASTDEPLOY_MOONCAKE_DEFAULTS: dict[str, Any] = {
    "local_hostname": "localhost",
    "global_segment_size": 1 << 30,
    "local_buffer_size": 128 << 20,
    "protocol": "rdma",
}
#: backends FastDeploy reaches through its own token-addressed branch, not this adapter
_TOKEN_BACKENDS = {"attentionstore"}


def parse_backend_spec(spec: str) -> str:
    """The kvcore backend name in ``kvcore:<name>``; a ValueError names the bad argument."""
    if not isinstance(spec, str) or not spec.startswith(BACKEND_PREFIX):
        raise ValueError(
            f"--kvcache_storage_backend {spec!r}: a kvcore backend is given as "
            f"'{BACKEND_PREFIX}<name>' (e.g. 'kvcore:file')"
        )
    name = spec[len(BACKEND_PREFIX) :]
    if not name:
        raise ValueError(f"--kvcache_storage_backend {spec!r}: the backend name is empty")
    if name in _TOKEN_BACKENDS:
        raise ValueError(
            f"--kvcache_storage_backend {spec!r}: {name!r} is token-addressed and moves device "
            "memory itself; FastDeploy drives it through its own 'attention_store' backend, "
            "which calls the same SDK the same way"
        )
    return name


def verify_blocks_setting(environ: Mapping[str, str] | None = None) -> str:
    """The ``verify_blocks`` the backend is opened with (:data:`VERIFY_BLOCKS_ENV`)."""
    env = os.environ if environ is None else environ
    value = env.get(VERIFY_BLOCKS_ENV) or "auto"
    if value not in ("auto", "always", "never"):
        raise ValueError(f"{VERIFY_BLOCKS_ENV} is {value!r}; it is one of auto, always, never")
    return value


#: seconds after which a backend that could not be opened (a Mooncake master not up yet) is
#: tried again; until then every call is a miss (0: never again)
REOPEN_ENV = "KVCORE_FASTDEPLOY_REOPEN_INTERVAL_S"
#: the engine's tenant settings (``kvcore.tenants.TenantSettings``): a JSON object or the path
#: of a JSON file. FastDeploy's calls carry keys, no request: every block is its
#: ``default_tenant``'s (one tenant per engine)
TENANTS_ENV = "KVCORE_FASTDEPLOY_TENANTS"


def reopen_interval_setting(environ: Mapping[str, str] | None = None) -> float:
    """The reopen interval (:data:`REOPEN_ENV`, default 30 s)."""
    env = os.environ if environ is None else environ
    raw = env.get(REOPEN_ENV) or "30"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{REOPEN_ENV} is {raw!r}; it is a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{REOPEN_ENV} is {raw!r}; it is a finite number of seconds >= 0")
    return value


def fastdeploy_backend_config(
    name: str, *, tp_rank: int = 0, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The backend config FastDeploy's environment implies for kvcore backend ``name``."""
    env = os.environ if environ is None else environ
    if name == "file":
        var, default = FASTDEPLOY_FILE_ENV
        config: dict[str, Any] = {"root": env.get(var) or default}
    elif name == "mooncake":
        config = _mooncake_config(env, tp_rank)
    else:
        config = {}
    extra = env.get(EXTRA_CONFIG_ENV)
    if extra:
        try:
            config.update(parse_config_arg(extra))
        except ValueError as exc:
            raise ValueError(f"{EXTRA_CONFIG_ENV}: {exc}") from None
    return config


def _mooncake_config(env: Mapping[str, str], tp_rank: int) -> dict[str, Any]:
    # a health probe needs the master's metrics port, which FastDeploy never configures; keys
    # are FastDeploy's own names, as its MooncakeStore writes them (data interoperates)
    config: dict[str, Any] = {"master_metrics_port": None, "key_scheme": "as_is"}
    path = env.get("MOONCAKE_CONFIG_PATH")
    if path:
        # as FastDeploy: the file replaces the variables (kv_mooncake reads it, key aliases
        # such as master_server_addr included); FastDeploy's defaults fill what it omits
        config["config_path"] = path
        return {**_FASTDEPLOY_MOONCAKE_DEFAULTS, **config}
    config.update(_FASTDEPLOY_MOONCAKE_DEFAULTS)
    for var, field in FASTDEPLOY_MOONCAKE_ENV.items():
        value = env.get(var)
        if value:
            config[field] = value
    devices = config.get("rdma_devices", "")
    if devices and "," in devices:
        # FastDeploy's select_rdma_device: rank r uses entry r % len of the comma list
        entries = [d.strip() for d in devices.split(",") if d.strip()]
        config["rdma_devices"] = entries[tp_rank % len(entries)]
    elif not devices and config["protocol"] == "rdma":
        config["rdma_devices"] = "auto"  # FastDeploy discovers the NICs when none are named
    return config


class FastDeploySettings(EngineBackendSettings):
    """The kvcore side of ``--kvcache-storage-backend kvcore:<name>``, from FastDeploy's
    argument, its model id and its environment (:meth:`from_environment`): the backend, its
    config (:func:`fastdeploy_backend_config`), the namespace, :data:`REOPEN_ENV` and
    :data:`VERIFY_BLOCKS_ENV`.

    .. versionadded:: 0.3
    """

    namespace: str = Field(
        description="FastDeploy's model id (its file store's subdirectory); the store's "
        "namespace adds the TP degree and the cache's format to it"
    )
    verify_blocks: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="digests beside every object of a backend without checksums (auto), or "
        "none (never: FastDeploy's own stores write beside kvcore); see kvcore.integrity",
    )

    @classmethod
    def from_environment(
        cls,
        spec: str,
        *,
        namespace: str,
        tp_rank: int = 0,
        config: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> FastDeploySettings:
        """The settings of backend ``spec`` (``kvcore:<name>``) for rank ``tp_rank`` of model
        ``namespace``: the backend config FastDeploy's environment implies, updated by
        ``config``.

        :raises ValueError: naming the argument or the variable whose value is wrong.
        """
        name = parse_backend_spec(spec)
        backend_config = fastdeploy_backend_config(name, tp_rank=tp_rank, environ=environ)
        backend_config.update(config or {})
        values = {
            "backend": name,
            "backend_config": backend_config,
            "namespace": namespace,
            "reopen_interval_s": reopen_interval_setting(environ),
            "verify_blocks": verify_blocks_setting(environ),
        }
        tenants = (os.environ if environ is None else environ).get(TENANTS_ENV)
        if tenants:
            try:
                values["tenants"] = parse_config_arg(tenants)
            except ValueError as exc:
                raise ValueError(f"kvcore for FastDeploy: {TENANTS_ENV}: {exc}") from None
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            # where each value came from: FastDeploy's argument, its model id or a variable
            sources = {
                "backend": f"--kvcache_storage_backend {spec!r}",
                "backend_config": f"the backend config ({EXTRA_CONFIG_ENV} and the variables)",
                "namespace": "FastDeploy's model id (the namespace)",
                "reopen_interval_s": REOPEN_ENV,
                "verify_blocks": VERIFY_BLOCKS_ENV,
                "tenants": TENANTS_ENV,
            }
            problems = []
            for err in exc.errors():
                field = str(err["loc"][0]) if err["loc"] else ""
                problems.append(f"{sources.get(field, field)}: {err['msg']}")
            raise ValueError("kvcore for FastDeploy: " + "; ".join(problems)) from None
