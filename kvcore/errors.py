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
    """A config or task failed validation; the message names each offending field."""

    @classmethod
    def from_validation(cls, what: str, exc: ValidationError) -> ConfigError:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            # a model-level check names its fields in its message
            lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")
        return cls(f"invalid {what}:\n" + "\n".join(lines))


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
