"""pytest plugin (entry point ``pytest11: kvcore``): run the conformance kit from the command line.

``pytest --kvcore-backend NAME [--kvcore-config JSON_OR_PATH]`` collects
:mod:`kvcore.testing.installed` (alone, or beside the paths given) and runs
:class:`~kvcore.testing.BackendConformance` against the installed backend ``NAME``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcore.config import parse_config_arg


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcore", "kvcore backend conformance")
    group.addoption(
        "--kvcore-backend",
        metavar="NAME",
        default=None,
        help="run the kvcore conformance kit against the installed backend NAME",
    )
    group.addoption(
        "--kvcore-config",
        metavar="JSON_OR_PATH",
        default=None,
        help="backend config for --kvcore-backend: inline JSON or a path to a JSON file",
    )


def load_config_arg(value: str | None) -> dict[str, Any]:
    """Parse ``--kvcore-config``: inline JSON object, or a path to a JSON file."""
    try:
        return parse_config_arg(value)
    except ValueError as exc:
        raise pytest.UsageError(f"--kvcore-config: {exc}") from None


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("kvcore_backend"):
        return
    suite = str(Path(__file__).with_name("installed.py"))
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        config.args.append(suite)
    else:  # no paths given: run the kit alone
        config.args[:] = [suite]
