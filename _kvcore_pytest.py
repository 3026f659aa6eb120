"""kvcore's pytest plugin as pytest loads it: the module of the ``pytest11: kvcore`` entry point.

pytest loads every installed ``pytest11`` plugin in every run, and nearly all of those runs have
nothing to do with kvcore. So this module imports nothing of kvcore (and nothing of pytest but
what a run has loaded already): it only registers ``--kvcore-backend`` and ``--kvcore-config``.
kvcore and its conformance kit are imported when ``--kvcore-backend`` is given, and then the kit
runs against that installed backend (:mod:`kvcore.testing.installed`).

It is a top-level module because importing any ``kvcore.*`` module imports ``kvcore`` itself.
Its public name is :mod:`kvcore.testing.plugin` (``-p kvcore.testing.plugin`` where plugin
autoloading is off), which uses these same hooks; loaded under both names, the plugin acts once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

__all__ = ["pytest_addoption", "pytest_configure"]

_GROUP = "kvcore"
_OPTIONS = ("--kvcore-backend", "--kvcore-config")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup(_GROUP, "kvcore backend conformance")
    if any(name in _OPTIONS for option in group.options for name in option.names()):
        return  # loaded twice (the entry point and -p kvcore.testing.plugin): added already
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


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("kvcore_backend"):
        return
    # only now: these import pytest (loaded already, in a run) and kvcore with the kit, whose
    # package registers its modules for assertion rewriting before it imports them
    from importlib.util import find_spec

    import pytest

    spec = find_spec("kvcore.testing.installed")
    suite = spec.origin if spec is not None else None
    if suite is None:
        raise pytest.UsageError("--kvcore-backend: kvcore.testing.installed is not installed")
    if suite in config.args:
        return  # loaded twice: the suite is there already
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        config.args.append(suite)
    else:  # no paths given: run the kit alone
        config.args[:] = [suite]
