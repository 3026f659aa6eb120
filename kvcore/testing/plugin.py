"""pytest plugin: run the conformance kit from the command line.

``pytest --kvcore-backend NAME [--kvcore-config JSON_OR_PATH]`` collects
:mod:`kvcore.testing.installed` (alone, or beside the paths given) and runs
:class:`~kvcore.testing.BackendConformance` against the installed backend ``NAME``.

This is the plugin's public name, for ``-p kvcore.testing.plugin`` where pytest does not load
installed plugins by itself. The ``pytest11: kvcore`` entry point loads the same hooks from
:mod:`_kvcore_pytest`, which imports nothing of kvcore, so that a pytest run without
``--kvcore-backend`` does not pay for importing kvcore and the kit.
"""

from __future__ import annotations

from typing import Any

import pytest

from _kvcore_pytest import pytest_addoption, pytest_configure
from kvcore.config import parse_config_arg

__all__ = ["load_config_arg", "pytest_addoption", "pytest_configure"]


def load_config_arg(value: str | None) -> dict[str, Any]:
    """Parse ``--kvcore-config``: inline JSON object, or a path to a JSON file."""
    try:
        return parse_config_arg(value)
    except ValueError as exc:
        raise pytest.UsageError(f"--kvcore-config: {exc}") from None
