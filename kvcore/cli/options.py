"""Options several commands share, defined once: ``--config`` and how its value is read."""

from __future__ import annotations

import argparse
from typing import Any

from kvcore.cli.errors import CliError, ExitCode
from kvcore.config import parse_config_arg

__all__ = ["add_config_option", "load_config_arg"]


def add_config_option(
    parser: argparse.ArgumentParser, *, what: str = "backend config", detail: str = ""
) -> None:
    """``--config``: a backend's config as inline JSON or a JSON file's path (read with
    :func:`load_config_arg`). ``what`` names it in the help, ``detail`` says what the command
    does with it."""
    more = f"; {detail}" if detail else ""
    parser.add_argument(
        "--config",
        default=None,
        metavar="JSON_OR_PATH",
        help=f"{what}: a JSON object or the path of a JSON file{more} (default: the backend's "
        "defaults)",
    )


def load_config_arg(value: str | None) -> dict[str, Any]:
    """``--config`` takes inline JSON (``'{"root": "/data"}'``) or a path to a JSON file."""
    try:
        return parse_config_arg(value)
    except ValueError as exc:
        raise CliError(f"--config: {exc}", ExitCode.CONFIG) from None
