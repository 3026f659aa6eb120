"""docs/writing-a-backend.md is what a stranger copies: every Python block of it must run.

The guide's blocks are of three kinds, told apart by a first line naming a file:

- ``# some/module.py``: a file of the reader's package, written into a scratch project;
- ``# pyproject.toml``: the packaging, from which the scratch project gets an installed
  distribution's metadata (so the backend is found by its entry-point name, as after
  ``pip install -e .``);
- ``# tests/test_*.py``: the reader's tests, run with pytest in that project;
- anything else: a snippet; the snippets run in order, in one interpreter, as a reader
  pasting them into one session would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before 3.11
    import tomli as tomllib

GUIDE = Path(__file__).parents[1] / "docs" / "writing-a-backend.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.DOTALL | re.MULTILINE)
FILE_HEADER = re.compile(r"^# ([\w./-]+\.(?:py|toml))\n")

# Runs the snippets in one namespace; says which one failed and how.
RUNNER = """
import json, sys, traceback
snippets = json.load(open(sys.argv[1]))
namespace = {"__name__": "__guide__"}
for index, code in enumerate(snippets):
    try:
        exec(compile(code, f"<guide snippet {index}>", "exec"), namespace)
    except BaseException:
        print(f"snippet {index} failed:\\n{code}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def guide_blocks() -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in FENCE.findall(GUIDE.read_text())]


def install_metadata(project: Path, pyproject: str) -> None:
    """What ``pip install -e .`` leaves for entry-point discovery: a dist-info directory."""
    meta = tomllib.loads(pyproject)["project"]
    info = project / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n"
    )
    lines = []
    for group, entries in meta.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def test_the_guide_has_a_package_its_packaging_and_its_tests() -> None:
    headers = [FILE_HEADER.match(body) for _, body in guide_blocks()]
    files = {m.group(1) for m in headers if m}
    assert "pyproject.toml" in files
    assert any(f.startswith("tests/") for f in files)
    assert any(f.endswith(".py") and not f.startswith("tests/") for f in files)


def test_every_python_block_of_the_backend_guide_runs(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    project = pytester.path
    snippets: list[str] = []
    test_files: list[str] = []
    for lang, body in guide_blocks():
        header = FILE_HEADER.match(body)
        if header and header.group(1) == "pyproject.toml":
            install_metadata(project, body)
        elif header:
            path = project / header.group(1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
            if header.group(1).startswith("tests/"):
                test_files.append(header.group(1))
        elif lang == "python":
            snippets.append(body)
    assert snippets and test_files

    # the snippets, in a fresh interpreter that sees the scratch project as installed
    listing = tmp_path / "snippets.json"
    listing.write_text(json.dumps(snippets))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(project), *sys.path])}
    env.pop("KVCORE_MY_CAPACITY_BYTES", None)
    run = subprocess.run(
        [sys.executable, "-c", RUNNER, str(listing)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-6000:]

    # the reader's tests: the conformance kit on the guide's backend, by its entry-point name
    pytester.syspathinsert(project)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider", *test_files)
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, result.stdout.str()
    assert outcomes.get("passed", 0) >= 40, outcomes
