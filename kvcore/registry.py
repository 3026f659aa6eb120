"""Discover backends through the ``kvcore.backends`` entry-point group and open one by name.

Listing never imports a backend; opening imports only the one asked for, so a broken or
missing optional backend cannot affect another.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import importlib_metadata
import pluggy
from pydantic import BaseModel, ValidationError

from kvcore import hookspecs
from kvcore.backend import Backend, VerifyBlocks
from kvcore.config import BackendConfig, parse_config_arg
from kvcore.errors import (
    BackendDefinitionError,
    BackendImportError,
    ConfigError,
    DuplicateBackendError,
    UnknownBackendError,
)
from kvcore.schemas import BackendContext, Capabilities
from kvcore.threads import io_affinity

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendInfo",
    "available_backends",
    "check_backend_class",
    "check_backend_config",
    "load_backend_class",
    "open_backend",
]

ENTRY_POINT_GROUP = "kvcore.backends"
DISABLE_ENV = "KVCORE_DISABLE_BACKENDS"


@dataclass(frozen=True)
class BackendInfo:
    """An installed backend, as its distribution's metadata declares it (nothing imported)."""

    name: str
    distribution: str
    version: str
    value: str  # "module:attr"
    entry_point: importlib_metadata.EntryPoint


def _disabled() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


def available_backends() -> list[BackendInfo]:
    """Installed backends sorted by name, minus those named in ``KVCORE_DISABLE_BACKENDS``.

    A name claimed by two distributions appears twice; :func:`open_backend` refuses it.
    """
    disabled = _disabled()
    found = []
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in disabled:
            continue
        dist = ep.dist
        found.append(
            BackendInfo(
                name=ep.name,
                distribution=dist.name if dist is not None else "?",
                version=dist.version if dist is not None else "?",
                value=ep.value,
                entry_point=ep,
            )
        )
    return sorted(found, key=lambda b: (b.name, b.distribution))


def _find(name: str) -> BackendInfo:
    candidates = [b for b in available_backends() if b.name == name]
    if not candidates:
        installed = sorted({b.name for b in available_backends()})
        hint = "disabled by KVCORE_DISABLE_BACKENDS; " if name in _disabled() else ""
        listing = ", ".join(installed) if installed else "none"
        raise UnknownBackendError(
            f"no kvcore backend named {name!r} ({hint}installed backends: {listing})"
        )
    if len(candidates) > 1:
        owners = " and ".join(f"{c.distribution} {c.version} ({c.value})" for c in candidates)
        raise DuplicateBackendError(
            f"backend name {name!r} is published by more than one distribution: {owners}; "
            "uninstall one of them"
        )
    return candidates[0]


def load_backend_class(name: str) -> type[Any]:
    """Import the backend published as ``name`` and check it declares the contract."""
    info = _find(name)
    try:
        factory = info.entry_point.load()
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        what = f"module {missing!r} is missing" if missing else str(exc)
        raise BackendImportError(
            f"backend {name!r} from {info.distribution} {info.version} failed to import: {what}. "
            f"Reinstall it with its dependencies: pip install {info.distribution!r}"
        ) from exc
    except Exception as exc:  # a backend's import-time bug must not look like ours
        raise BackendImportError(
            f"backend {name!r} from {info.distribution} {info.version} raised on import: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    _check_definition(name, factory)
    return factory


def _check_definition(name: str, factory: Any) -> None:
    model = getattr(factory, "config_model", None)
    if not (isinstance(model, type) and issubclass(model, BackendConfig)):
        raise BackendDefinitionError(
            f"backend {name!r}: {factory!r} must have a `config_model` attribute that subclasses "
            "kvcore.BackendConfig"
        )
    if not isinstance(getattr(factory, "capabilities", None), Capabilities):
        raise BackendDefinitionError(
            f"backend {name!r}: {factory!r} must have a `capabilities` attribute that is a "
            "kvcore.Capabilities"
        )


def validate_config(
    name: str, factory: Any, config: BaseModel | Mapping[str, Any] | str | None
) -> BackendConfig:
    """Validate ``config`` with the backend's own model (environment overrides applied).

    ``config`` is a dict, an instance of the backend's ``config_model``, or a string: inline
    JSON (``'{"root": "/data"}'``) or the path of a JSON file.
    """
    model: type[BackendConfig] = factory.config_model
    if isinstance(config, str):
        try:
            config = parse_config_arg(config)
        except ValueError as exc:
            raise ConfigError(f"config for backend {name!r}: {exc}") from None
    if isinstance(config, model):
        config = config.model_dump(exclude_unset=True)
    elif isinstance(config, BaseModel):
        raise ConfigError(
            f"config for backend {name!r} is a {type(config).__name__}, expected "
            f"{model.__name__} or a dict"
        )
    try:
        return model.load(dict(config or {}))
    except ValidationError as exc:
        raise ConfigError.from_validation(f"config for backend {name!r}", exc) from None


def check_backend_class(name: str | type) -> type[Any]:
    """Check a backend's definition as opening would, without an instance: import it (by
    name), check ``config_model`` and ``capabilities``, and register the class itself with a
    plugin manager, so a misspelled hook or a missing required hook fails here. No server, SDK
    or file is touched. Returns the class.

    :raises UnknownBackendError, DuplicateBackendError, BackendImportError,
        BackendDefinitionError: as :func:`open_backend` would.
    """
    if isinstance(name, str):
        factory, label = load_backend_class(name), name
    else:
        factory, label = name, getattr(name, "name", None) or name.__name__
        _check_definition(label, factory)
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    try:
        _register(label, pm, factory)
    finally:
        with contextlib.suppress(Exception):
            pm.unregister(factory)
    return factory


def check_backend_config(
    name: str, config: BaseModel | Mapping[str, Any] | str | None = None, where: str = ""
) -> BackendConfig:
    """Validate ``config`` for the backend published as ``name`` without opening it.

    For adapters and operators that want a bad config to fail where it is read (an engine's
    startup) rather than when the backend is first opened. Imports the backend's class (as
    opening would) but constructs nothing and connects to nothing.

    :param where: where ``config`` sits in the settings the user wrote (e.g. ``lmcache
        adapter_params.backend_config``): a bad field is then named from there, one line.
    :raises UnknownBackendError, DuplicateBackendError, BackendImportError,
        BackendDefinitionError, ConfigError: as :func:`open_backend` would.

    .. versionchanged:: 0.3 ``where``.
    """
    factory = load_backend_class(name)
    try:
        return validate_config(name, factory, config)
    except ConfigError as exc:
        if not where:
            raise
        raise exc.under(where) from None


def open_backend(
    name: str | type,
    config: BaseModel | Mapping[str, Any] | str | None = None,
    *,
    context: BackendContext | Mapping[str, Any] | None = None,
    strict: bool = False,
    verify_blocks: VerifyBlocks = "auto",
) -> Backend:
    """Open the backend published as ``name`` (or given directly as a class).

    :param config: the backend's settings: an instance of its ``config_model``, a dict, or a
        string holding inline JSON or the path of a JSON file; ``<env_prefix><FIELD>``
        environment variables override them.
    :param context: the engine's layout, rank and world size (a :class:`BackendContext`).
    :param strict: let backend exceptions propagate instead of turning them into counted
        misses (for tests).
    :param verify_blocks: keep block digests beside every block and check every block read
        (:mod:`kvcore.integrity`): ``auto`` (default) for backends that keep no checksums of
        their own, ``always``, or ``never`` (a benchmark's control; nothing else should).
    :raises UnknownBackendError, DuplicateBackendError, BackendImportError,
        BackendDefinitionError, ConfigError: with a message that says what to do.

    .. versionchanged:: 0.3 ``verify_blocks``: verification is the opened backend's, for
       every caller (it was the transfer manager's alone)
    """
    if verify_blocks not in ("auto", "always", "never"):
        raise ConfigError(
            f"verify_blocks is {verify_blocks!r}; it is one of 'auto', 'always', 'never'"
        )
    if isinstance(name, str):
        factory = load_backend_class(name)
        label = name
    else:
        factory = name
        label = getattr(factory, "name", None) or factory.__name__
        _check_definition(label, factory)
    cfg = validate_config(label, factory, config)
    try:
        ctx = (
            context
            if isinstance(context, BackendContext)
            else BackendContext.model_validate(dict(context or {}))
        )
    except ValidationError as exc:
        raise ConfigError.from_validation("backend context", exc) from None

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    # threads the backend starts while opening (its pools, a client library's connections)
    # run on kvcore's I/O cores, not on the caller's pinning (see kvcore.threads)
    with io_affinity():
        plugin = factory(cfg, ctx)
    try:
        _register(label, pm, plugin)
    except Exception:
        _close_quietly(pm)
        raise
    # an instance may declare what its config makes it capable of (a stack of backends: what
    # every tier honours); the class's declaration is the default
    capabilities = getattr(plugin, "capabilities", factory.capabilities)
    if not isinstance(capabilities, Capabilities):
        _close_quietly(pm)
        raise BackendDefinitionError(
            f"backend {label!r}: the opened instance's `capabilities` is {capabilities!r}, "
            "not a kvcore.Capabilities"
        )
    return Backend(
        label, plugin, pm, cfg, ctx, capabilities, strict=strict, verify_blocks=verify_blocks
    )


def _register(label: str, pm: pluggy.PluginManager, plugin: Any) -> None:
    try:
        pm.register(plugin, name=label)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise BackendDefinitionError(f"backend {label!r}: {exc}") from exc
    implemented = {impl_name for impl_name in hookspecs.REQUIRED_HOOKS if _has_impl(pm, impl_name)}
    missing = [h for h in hookspecs.REQUIRED_HOOKS if h not in implemented]
    if missing:
        raise BackendDefinitionError(
            f"backend {label!r} implements no {', '.join(missing)} "
            "(decorate the methods with @kvcore.hookimpl)"
        )


def _has_impl(pm: pluggy.PluginManager, hook_name: str) -> bool:
    return bool(getattr(pm.hook, hook_name).get_hookimpls())


def _close_quietly(pm: pluggy.PluginManager) -> None:
    with contextlib.suppress(Exception):  # already failing: the original error matters
        pm.hook.kvcore_close()
