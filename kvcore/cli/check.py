"""``kvcore check NAME``: the conformance kit against an installed backend, summarised.

The backend is opened once first, with the kit's own small layout: a backend that cannot
open (unknown name, bad config, missing SDK, broken hook, unreachable server) stops the
command with that one reason instead of failing every test of the kit with it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvcore.cli.common import open_for_cli
from kvcore.cli.console import CommandConsole
from kvcore.cli.errors import ExitCode
from kvcore.schemas import BackendContext


class _Tally:
    """Outcomes as pytest reports them, errors (a fixture or teardown failed) kept apart from
    failures (a test's assertion failed)."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.failed: list[str] = []
        self.errors: list[str] = []

    def pytest_runtest_logreport(self, report: Any) -> None:
        test = report.nodeid.split("::", 1)[-1]
        if report.when == "call":
            self.outcomes[report.outcome] += 1
            if report.outcome == "failed":
                self.failed.append(test)
        elif report.outcome == "failed":  # setup or teardown
            self.outcomes["error"] += 1
            self.errors.append(f"{test} ({report.when})")
        elif report.when == "setup" and report.outcome == "skipped":
            self.outcomes["skipped"] += 1


def run(args: argparse.Namespace, console: CommandConsole) -> int:
    from kvcore.cli.options import load_config_arg
    from kvcore.testing.suite import small_layout

    config = load_config_arg(args.config)
    # one opening first: if it fails, every test of the kit would fail the same way
    open_for_cli(args.name, config, BackendContext(layout=small_layout())).close()

    tally = _Tally()
    with tempfile.TemporaryDirectory(prefix="kvcore-check-") as home:
        # an empty ini of our own: the current directory's pytest settings must not apply
        ini = Path(home) / "pytest.ini"
        ini.write_text("[pytest]\n")
        argv = [
            "-q",
            "--no-header",
            "--tb=short",
            "-p",
            "no:cacheprovider",
            "-c",
            str(ini),
            "--rootdir",
            home,
            "--kvcore-backend",
            args.name,
        ]
        if config:
            argv += ["--kvcore-config", json.dumps(config)]
        if args.keyword:
            argv += ["-k", args.keyword]
        code = pytest.main(argv, plugins=[tally])
    o = tally.outcomes
    console.out.print()
    console.out.print(
        f"kvcore check {args.name}: {o['passed']} passed, {o['failed']} failed, "
        f"{o['error']} errors, {o['skipped']} skipped",
        markup=False,
    )
    for name in tally.failed:
        console.out.print(f"  FAILED {name}", markup=False)
    for name in tally.errors:
        console.out.print(f"  ERROR {name}", markup=False)
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        console.out.print(f"  no test matched -k {args.keyword!r}", markup=False)
    return ExitCode.OK if code == pytest.ExitCode.OK else ExitCode.FAILED
