"""docs/operator-guide.md: every Python block runs, in order, in one fresh interpreter; its
tables say what the code does (exit codes, variables, CLI options)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from kvcore.cli import _parser
from kvcore.cli.errors import ExitCode

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "operator-guide.md"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)


def test_every_python_block_runs_in_order(tmp_path):
    blocks = FENCE.findall(GUIDE.read_text())
    assert len(blocks) >= 2
    script = "\n\n".join(f"# --- block {i}\n{code}" for i, code in enumerate(blocks))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    env["KVCORE_FILE_ROOT"] = str(tmp_path / "store")  # nothing written outside tmp_path
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(environment variable KVCORE_FILE_CAPACITY_BYTES)" in out.stdout
    assert re.search(r"^http://127\.0\.0\.1:\d+/metrics$", out.stdout, re.M)


def test_the_exit_code_table_matches_the_cli():
    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", GUIDE.read_text(), re.M))
    assert {int(code) for code in rows} == {int(c) for c in ExitCode}


def test_every_cli_option_is_in_the_guide():
    text = GUIDE.read_text()
    top = _parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    for parser in [top, *sub.choices.values()]:
        for action in parser._actions:
            for flag in action.option_strings:
                if flag in ("-h", "--help"):
                    continue
                assert flag in text, f"{parser.prog} {flag} is not documented"


def test_the_core_variables_the_code_reads_are_documented():
    text = GUIDE.read_text()
    for variable in ("KVCORE_DEBUG", "KVCORE_LOG_DIR", "KVCORE_DISABLE_BACKENDS"):
        assert f"`{variable}" in text
