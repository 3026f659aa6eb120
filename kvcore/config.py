"""Configuration read from dicts and the environment, on the strict base all kvcore models share.

``StrictModel`` (unknown fields are errors) is the base of configs, tasks and the cache layout
alike; ``EnvConfig`` adds environment overrides (``<env_prefix><FIELD>`` variables, errors that
name the variable), ``BackendConfig`` is every backend's config base, ``timeout_field`` and
``interval_field`` declare durations, ``parse_config_arg`` reads a config given on a command line.
``kvcore.schemas`` re-exports all of them. ``EngineBackendSettings`` is the base of an engine
adapter's settings (the backend it opens by name, its config, the namespace, the reopen
interval), and ``check_namespace`` the one rule a namespace follows.
"""

from __future__ import annotations

import json
import os
import re
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import InitErrorDetails
from pydantic_settings import EnvSettingsSource
from typing_extensions import Self

from kvcore.tenants import TenantSettings

__all__ = [
    "MAX_NAMESPACE_CHARS",
    "MAX_TIMEOUT_S",
    "BackendConfig",
    "EngineBackendSettings",
    "EnvConfig",
    "LoadPolicy",
    "SettingsModel",
    "StrictModel",
    "check_namespace",
    "interval_field",
    "parse_config_arg",
    "timeout_field",
]


class StrictModel(BaseModel):
    """Base for every kvcore model: unknown fields are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def parse_config_arg(value: str | None) -> dict[str, Any]:
    """A config given on a command line: inline JSON object, or a path to a JSON file.

    Raises ValueError with a message that says which of the two went wrong.
    """
    if not value:
        return {}
    text = value.strip()
    if not text.startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"{value!r} is neither a JSON object nor a file")
        text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    return data


class _EnvironSource(EnvSettingsSource):
    """pydantic-settings' environment source, reading a given mapping instead of os.environ
    (so :meth:`EnvConfig.load` can be tested, and called with an engine's own environment)."""

    def __init__(self, model: type[BaseModel], prefix: str, environ: Mapping[str, str]) -> None:
        self._environ = environ
        # typed for BaseSettings, but the source only reads the model's fields and config, so
        # any pydantic model will do
        super().__init__(model, case_sensitive=False, env_prefix=prefix)  # type: ignore[arg-type]

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {name.lower(): value for name, value in self._environ.items()}


def _admits_bool(annotation: Any) -> bool:
    """Whether a field's type takes a bool (``bool``, ``Any``, a union or literal holding one)."""
    if annotation in (bool, Any, object) or annotation is None:
        return True
    if isinstance(annotation, str):  # an unresolved forward reference: do not judge it
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in args)
    return any(_admits_bool(a) for a in args if a is not type(None))


class SettingsModel(StrictModel):
    """Base of every model of settings (a backend's config, an engine adapter's settings):
    a number field takes numbers.

    .. versionadded:: 0.3
    """

    @field_validator("*", mode="before")
    @classmethod
    def _strict_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """``True`` is not a size, a count or a rate (Python's bool is an int: pydantic would
        take it as 1), and a subnormal float (below 2.2e-308) means nothing as a setting."""
        field = cls.model_fields.get(info.field_name or "")
        if field is None or not isinstance(value, (bool, float)):
            return value
        if isinstance(value, bool) and not _admits_bool(field.annotation):
            raise ValueError("must be a number, not a boolean")
        if isinstance(value, float) and 0 < abs(value) < sys.float_info.min:
            raise ValueError(f"{value!r} is a subnormal number: too small to be a setting")
        return value


class EnvConfig(SettingsModel):
    """A config whose fields operators can override with environment variables.

    Subclasses set ``env_prefix`` (e.g. ``"KVCORE_FILE_"``); :meth:`load` then applies
    ``KVCORE_FILE_ROOT=/data`` as ``root``. Values in the environment override the given config
    (an operator's knob beats a baked-in file). Variables are read by pydantic-settings'
    environment source, so they follow its conventions: names are matched case-insensitively,
    lists, dicts and models are JSON, scalars are coerced by the field's type (``true``,
    ``42``, ``64GiB`` for a size). An invalid value is an error that names the variable.
    """

    env_prefix: ClassVar[str] = ""

    #: names accepted from the environment besides the fields (moved into place by a
    #: validator), with whether their value is a plain string
    env_extra_fields: ClassVar[tuple[str, ...]] = ()
    env_extra_strings: ClassVar[frozenset[str]] = frozenset({"namespace", "weight_version"})

    @classmethod
    def env_overrides(cls, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The values set by ``<env_prefix><FIELD>`` variables, by field name.

        Raises ValidationError naming the variable when a list, dict or model field's value
        is not JSON.
        """
        environ = os.environ if environ is None else environ
        found: dict[str, Any] = {}
        if not cls.env_prefix:
            return found
        source = _EnvironSource(cls, cls.env_prefix, environ)
        bad: list[InitErrorDetails] = []
        for name, field in cls.model_fields.items():
            raw, key, complex_value = source.get_field_value(field, name)
            try:
                value = source.prepare_field_value(name, field, raw, complex_value)
            except ValueError as exc:  # a complex field whose value is not JSON
                variable = cls.env_variable(name)
                bad.append(
                    {
                        "type": "json_invalid",
                        "loc": (_env_loc(name, variable),),
                        "input": raw,
                        "ctx": {"error": str(exc)},
                    }
                )
                continue
            if value is not None:
                found[key] = value
        if bad:
            raise ValidationError.from_exception_data(cls.__name__, bad)
        # names that are not fields (a validator moves them into place): JSON unless a string
        for name in cls.env_extra_fields:
            raw = environ.get(cls.env_variable(name))
            if raw is None:
                continue
            if name in cls.env_extra_strings:
                found[name] = raw
            else:
                try:
                    found[name] = json.loads(raw)
                except json.JSONDecodeError:
                    found[name] = raw  # let pydantic coerce or report it
        return found

    @classmethod
    def env_variable(cls, name: str) -> str:
        """The variable that overrides field (or extra name) ``name``."""
        return f"{cls.env_prefix}{name.upper()}"

    @classmethod
    def env_variables_set(cls, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """``{name: variable}`` for the ``<env_prefix><NAME>`` variables present in ``environ``
        (subclasses that read other variables add theirs, so errors can name them)."""
        environ = os.environ if environ is None else environ
        if not cls.env_prefix:
            return {}
        present = {k.upper() for k in environ}
        names = (*cls.model_fields, *cls.env_extra_fields)
        return {n: cls.env_variable(n) for n in names if cls.env_variable(n) in present}

    @classmethod
    def load(
        cls,
        config: BaseModel | Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Self:
        """Validate ``config`` (a dict, a model or None) with environment overrides applied.

        :raises ValidationError: naming each invalid field, and for a value that came from the
            environment the variable that set it.
        """
        if isinstance(config, BaseModel):
            data = config.model_dump(exclude_unset=True)
        else:
            data = dict(config or {})
        data.update(cls.env_overrides(environ))
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            variables = cls.env_variables_set(environ)
            if not variables:
                raise
            raise _name_variables(cls.__name__, exc, variables) from None


def _env_loc(name: str, variable: str) -> str:
    return f"{name} (environment variable {variable})"


def _name_variables(
    title: str, exc: ValidationError, variables: Mapping[str, str]
) -> ValidationError:
    """``exc`` with each error caused by an environment value saying which variable set it."""
    details: list[InitErrorDetails] = []
    for err in exc.errors(include_url=False):
        loc = list(err["loc"])
        for i, part in enumerate(loc):
            if isinstance(part, str) and part in variables:
                loc[i] = _env_loc(part, variables[part])
                break
        detail: InitErrorDetails = {"type": err["type"], "loc": tuple(loc), "input": err["input"]}
        if "ctx" in err:
            detail["ctx"] = err["ctx"]
        try:  # a custom error type (ByteSize's) cannot be rebuilt: keep its message
            ValidationError.from_exception_data(title, [detail])
        except (KeyError, TypeError, ValueError):
            detail = {
                "type": "value_error",
                "loc": tuple(loc),
                "input": err["input"],
                "ctx": {"error": ValueError(err["msg"])},
            }
        details.append(detail)
    return ValidationError.from_exception_data(title, details)


#: The longest timeout anything in kvcore accepts: a week. Longer (or infinite) values would
#: overflow the deadline thread's waits; no cache operation is worth waiting longer.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def timeout_field(default: float | None, description: str) -> Any:
    """A timeout in seconds: positive, finite, at most :data:`MAX_TIMEOUT_S`."""
    return Field(
        default=default, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description=description
    )


def interval_field(default: float, description: str) -> Any:
    """A duration in seconds where 0 means "never" or "at once": finite, at most
    :data:`MAX_TIMEOUT_S`, like every timeout (a backend's config uses it for its own waits).

    .. versionadded:: 0.3
    """
    return Field(
        default=default, ge=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description=description
    )


class BackendConfig(EnvConfig):
    """Base of every backend's own config model (see :class:`EnvConfig` for ``env_prefix``)."""

    default_timeout_s: float = timeout_field(
        5.0, "deadline of a call whose request has none; the transfer manager's task default"
    )


#: The longest namespace: one directory name (kv_file keeps a namespace in a directory of that
#: name), with room left in a path.
#:
#: .. versionadded:: 0.3
MAX_NAMESPACE_CHARS = 128

# a letter, digit or '_' first (no '.', '..' or an option-like '-'), then those and '.', '-'
_NAMESPACE_RE = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9._-]{{0,{MAX_NAMESPACE_CHARS - 1}}}")


def check_namespace(value: str, field: str = "namespace") -> str:
    """``value`` if every backend takes it as a namespace: 1-128 characters from
    ``[A-Za-z0-9._-]``, not starting with ``.`` or ``-``. That is kv_file's rule, the strictest
    (a namespace becomes one directory name there, so it must never leave the store's root:
    no ``/``, no ``..``); a key-value store (Mooncake) takes any of them as a key prefix.

    :raises ValueError: naming ``field``.

    .. versionadded:: 0.3
    """
    if not isinstance(value, str) or not _NAMESPACE_RE.fullmatch(value):
        raise ValueError(
            f"{field} {value!r} must be 1-{MAX_NAMESPACE_CHARS} characters from "
            "[A-Za-z0-9._-], not starting with '.' or '-'"
        )
    return value


#: Whether an engine loads what the store holds (:mod:`kvcore.load_costs`).
LoadPolicy = Literal["auto", "always", "never"]


class EngineBackendSettings(SettingsModel):
    """Base of an engine adapter's settings: the kvcore backend it opens by name, that
    backend's config, the namespace its objects are named in, and how often a backend that
    could not be opened is tried again. Each adapter extends it with its own fields, and
    redeclares a field whose default differs (a default backend, its own namespace); the
    rules here (a named backend, one namespace rule, a config read once) hold for every
    subclass, since they are validators, not the field's declaration.

    Frozen: settings are read once, where the engine hands them over, and shared.

    .. versionadded:: 0.3
    .. versionchanged:: 0.3 ``load_policy``, ``load_margin`` and ``prefill_tokens_per_s``, the
       load-or-recompute decision's (one for every adapter); ``tenants`` and
       :meth:`tenant_of` (one for every adapter).
    """

    # hide_input_in_errors: an error's input would carry ``tenants.salts`` (secrets); each
    # message names its field and says what is wrong without it
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    backend: str = Field(
        description="kvcore backend name (an entry point of kvcore.backends: file, mooncake, "
        "memory, tiered, ...)"
    )
    backend_config: dict[str, Any] = Field(
        default_factory=dict,
        description="the backend's own config: an object, or a JSON string or the path of a "
        "JSON file (read once, here); validated by the backend, whose KVCORE_<BACKEND>_<FIELD> "
        "variables override it",
    )
    namespace: str = Field(
        default="default",
        description="leading part of every object's name: engines share what they store only "
        "within one namespace",
    )
    reopen_interval_s: float = interval_field(
        30.0,
        "a backend that cannot be opened (a server not up yet) does not stop the engine: every "
        "call is a miss until it opens, tried again after this long (0: never)",
    )
    load_policy: LoadPolicy = Field(
        default="auto",
        description="auto: load stored blocks only when reading them is expected to be faster "
        "than computing them (from the store's measured read rate and the engine's measured "
        "prefill rate: kvcore.load_costs); always: load whatever is found; never: recompute",
    )
    prefill_tokens_per_s: float | None = Field(
        default=None,
        gt=0,
        description="auto: the engine's prefill rate to assume until the adapter has measured "
        "one (adapters that see no engine step, SGLang's and LMCache's storage layers, use only "
        "this); unset: such an adapter loads whatever is found",
    )
    load_margin: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="auto: how much faster (a fraction) the other choice must be expected to be "
        "before the decision changes, so that requests in a row do not flap",
    )
    tenants: TenantSettings | None = Field(
        default=None,
        description="which tenant each request belongs to (its cache_salt in 'salts', or a "
        "tenant the engine names per request) and each tenant's share: kvcore.tenants; unset: "
        "requests name no tenant",
    )

    def tenant_of(self, *, tenant: str | None = None, salt: str | None = None) -> str | None:
        """The tenant a request belongs to (:meth:`kvcore.tenants.TenantSettings.tenant_of`),
        from the name the engine carries for it or its ``cache_salt``; None where no tenants
        are set (the request names none)."""
        if self.tenants is None:
            return None
        return self.tenants.tenant_of(tenant=tenant, salt=salt)

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("backend must name a kvcore backend (file, mooncake, ...)")
        return value

    @field_validator("backend_config", mode="before")
    @classmethod
    def _backend_config(cls, value: Any) -> Any:
        """A string is read the way :func:`kvcore.open_backend` reads one (inline JSON or a
        JSON file), once: a bad one fails here, naming this field, instead of at each open."""
        if value is None:
            return {}
        if isinstance(value, str):
            return parse_config_arg(value)  # its ValueError says which of the two went wrong
        if isinstance(value, Mapping):
            return dict(value)
        return value  # anything else: pydantic says it is not an object

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        # None only where a subclass makes the namespace optional (derived later)
        return None if value is None else check_namespace(value)
