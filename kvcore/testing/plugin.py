"""pytest plugin (entry point ``pytest11: kvcore``): run the conformance kit from the command line.

``pytest --kvcore-backend NAME [--kvcore-config JSON_OR_PATH]`` collects
:mod:`kvcore.testing.installed` (alone, or beside the paths given) and runs
:class:`~kvcore.testing.BackendConformance` against the installed backend ``NAME``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


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
    """Parse a ``--config``-style argument: inline JSON object, or a path to a JSON file."""
    if not value:
        return {}
    text = value.strip()
    if not text.startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise pytest.UsageError(f"--kvcore-config: {value!r} is neither JSON nor a file")
        text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise pytest.UsageError(f"--kvcore-config: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise pytest.UsageError("--kvcore-config: expected a JSON object")
    return data


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("kvcore_backend"):
        return
    suite = str(Path(__file__).with_name("installed.py"))
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        config.args.append(suite)
    else:  # no paths given: run the kit alone
        config.args[:] = [suite]
