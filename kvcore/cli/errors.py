"""How the ``kvcore`` command fails: one line on stderr and an exit code per kind of error.

The codes are documented in ``docs/operator-guide.md`` ("Exit codes"); scripts may rely on them.
"""

from __future__ import annotations

import enum

from pydantic import ValidationError

from kvcore.errors import (
    BackendDefinitionError,
    BackendImportError,
    ConfigError,
    DuplicateBackendError,
    UnknownBackendError,
)

__all__ = ["CliError", "ExitCode", "classify", "one_line"]


class ExitCode(enum.IntEnum):
    """What the exit status of ``kvcore`` means."""

    OK = 0
    #: the command ran and its verdict is negative: conformance tests failed, bytes differ
    FAILED = 1
    #: the command line itself is wrong (argparse's convention)
    USAGE = 2
    #: a config, a ``--config`` value or an environment variable is invalid
    CONFIG = 3
    #: no installed backend has that name
    UNKNOWN_BACKEND = 4
    #: two distributions publish the same backend name
    DUPLICATE_BACKEND = 5
    #: a backend, or something it needs (a vendor SDK, matplotlib for --plot), is not installed
    MISSING_DEPENDENCY = 6
    #: a backend breaks the plugin contract (a misspelled or missing hook, a bad class)
    BACKEND_DEFINITION = 7
    #: the backend could not open (an unreachable server, a refused connection, ...)
    BACKEND_UNAVAILABLE = 8
    #: the backend opened but failed during the run (its operations errored)
    BACKEND_FAILED = 9
    #: a bug in kvcore or in a backend: run again with --debug and report the traceback
    INTERNAL = 70
    #: interrupted (Ctrl-C)
    INTERRUPTED = 130


class CliError(Exception):
    """An error the CLI reports as ``kvcore: error: <message>`` with ``code`` as exit status."""

    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.code = code


def one_line(text: str) -> str:
    """A possibly multi-line message (a config error lists one field per line) as one line."""
    parts = [p.strip() for p in str(text).splitlines() if p.strip()]
    line = "; ".join(parts)
    # "invalid config ...:; root: ..." reads better without the separator after a colon
    return line.replace(":; ", ": ")


def classify(exc: BaseException) -> tuple[ExitCode, str]:
    """The exit code and one-line message for an exception that reached the CLI."""
    if isinstance(exc, CliError):
        return exc.code, one_line(str(exc))
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED, "interrupted"
    if isinstance(exc, UnknownBackendError):
        return ExitCode.UNKNOWN_BACKEND, one_line(str(exc))
    if isinstance(exc, DuplicateBackendError):
        return ExitCode.DUPLICATE_BACKEND, one_line(str(exc))
    if isinstance(exc, BackendDefinitionError):
        return ExitCode.BACKEND_DEFINITION, one_line(str(exc))
    if isinstance(exc, ConfigError):
        return ExitCode.CONFIG, one_line(str(exc))
    if isinstance(exc, ValidationError):
        return ExitCode.CONFIG, one_line(ConfigError.from_validation(exc.title, exc).args[0])
    if isinstance(exc, (BackendImportError, ImportError)):
        # a backend's SDK imported lazily when it opens raises a plain ImportError
        return ExitCode.MISSING_DEPENDENCY, one_line(str(exc))
    if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
        return ExitCode.BACKEND_UNAVAILABLE, one_line(f"{type(exc).__name__}: {exc}")
    return (
        ExitCode.INTERNAL,
        one_line(
            f"internal error: {type(exc).__name__}: {exc} (run again with --debug for the "
            "traceback, and report it)"
        ),
    )
