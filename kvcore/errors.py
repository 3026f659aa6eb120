"""Exceptions raised by kvcore's public API. Backends' own failures never surface as these."""

from __future__ import annotations

from pydantic import ValidationError

__all__ = [
    "BackendDefinitionError",
    "BackendImportError",
    "ConfigError",
    "DuplicateBackendError",
    "KVCoreError",
    "UnknownBackendError",
    "describe",
]


class KVCoreError(Exception):
    """Base of kvcore's errors."""


class UnknownBackendError(KVCoreError, LookupError):
    """No installed backend has the requested name; the message lists the installed ones."""


class DuplicateBackendError(KVCoreError):
    """Two distributions publish a backend under the same name."""


class BackendImportError(KVCoreError, ImportError):
    """A backend's module failed to import; the message says what to install."""


class BackendDefinitionError(KVCoreError, TypeError):
    """A backend breaks the plugin contract (misspelled hook, missing required hook, ...)."""


class ConfigError(KVCoreError, ValueError):
    """A config or task failed validation; the message names each offending field.

    .. versionchanged:: 0.3 :attr:`fields` and :meth:`under`.
    """

    #: ``(field, what is wrong)`` of each offending field, where validation said (``""``: a
    #: model-level check, which names its fields in its message)
    fields: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_validation(cls, what: str, exc: ValidationError) -> ConfigError:
        fields = tuple(
            (".".join(str(p) for p in err["loc"]), err["msg"].removeprefix("Value error, "))
            for err in exc.errors()
        )
        lines = [f"  {loc}: {msg}" if loc else f"  {msg}" for loc, msg in fields]
        error = cls(f"invalid {what}:\n" + "\n".join(lines))
        error.fields = fields
        return error

    def under(self, where: str) -> ConfigError:
        """The same error on one line, each field named from ``where`` (where this config sits
        in the setting a user wrote: ``lmcache adapter_params.backend_config``)."""
        if not self.fields:
            return ConfigError(f"{where}: {self}")
        error = ConfigError(
            "; ".join(
                f"{where}.{loc}: {msg}" if loc else f"{where}: {msg}" for loc, msg in self.fields
            )
        )
        error.fields = tuple((f"{where}.{loc}" if loc else where, msg) for loc, msg in self.fields)
        return error


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, whatever its ``__str__`` does: a backend's exception
    whose message cannot be built must still be reported as the failure it is, never escape the
    code reporting it.

    .. versionadded:: 0.3
    """
    kind = type(exc).__name__
    try:
        text = str(exc)
    except Exception as inner:  # the message itself failed
        text = f"<message not shown: its __str__ raised {type(inner).__name__}>"
    return f"{kind}: {text}" if text else kind
