"""``kvcore check NAME``: the conformance kit against an installed backend, summarised."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest


class _Tally:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.failed: list[str] = []

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.outcomes[report.outcome] += 1
            if report.outcome == "failed":
                self.failed.append(report.nodeid.split("::", 1)[-1])


def run(args: argparse.Namespace) -> int:
    from kvcore.cli import load_config_arg

    config = load_config_arg(args.config)
    tally = _Tally()
    with tempfile.TemporaryDirectory(prefix="kvcore-check-") as home:
        # an empty ini of our own: the current directory's pytest settings must not apply
        ini = Path(home) / "pytest.ini"
        ini.write_text("[pytest]\n")
        argv = [
            "-q",
            "--no-header",
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
    print()
    print(
        f"kvcore check {args.name}: {o['passed']} passed, {o['failed']} failed, "
        f"{o['skipped']} skipped"
    )
    for name in tally.failed:
        print(f"  FAILED {name}")
    return 0 if code == 0 else 1
