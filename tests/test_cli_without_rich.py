"""rich is the ``cli`` extra: without it the ``kvcore`` command prints the same lines as plain text,
and nothing outside ``kvcore/cli`` imports it (the core, the backends and the adapters never
need it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the console script's body, run where ``import rich`` fails as it does where rich is not
#: installed (a None in sys.modules makes every import of the name raise ImportError)
WITHOUT_RICH = """
import sys
sys.modules["rich"] = None
sys.argv[0] = "kvcore"
from kvcore.cli import main
code = main()
sys.stdout.flush()
loaded = sorted(m for m, mod in sys.modules.items() if m.startswith("rich") and mod is not None)
sys.stderr.write(f"rich modules loaded: {loaded}\\n")
sys.exit(code)
"""


def kvcore_without_rich(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    env["KVCORE_LOG_DIR"] = os.path.join(tempfile.gettempdir(), "kvcore-test-logs")
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_RICH, *args],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=300, check=False,
    )  # fmt: skip


def test_version_works_without_rich(tmp_path: Path) -> None:
    out = kvcore_without_rich("--version", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "kvcore", out.stdout


def test_backends_prints_its_table_as_plain_text_without_rich(tmp_path: Path) -> None:
    out = kvcore_without_rich("backends", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "rich modules loaded: []" in out.stderr, out.stderr
    lines = out.stdout.splitlines()
    assert re.match(r"NAME +DISTRIBUTION +VERSION +STATUS +CHECKED +CAPABILITIES$", lines[0])
    assert re.search(r"^memory +kvcore +\S+ +ok +import, class, hooks", out.stdout, re.M), lines
    assert "[green]" not in out.stdout and not [line for line in lines if line != line.rstrip()]
    assert any(line.startswith("native extensions: ") for line in lines), lines

    listed = kvcore_without_rich("backends", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "memory" in {row["name"] for row in json.loads(listed.stdout)}


def test_demo_runs_and_shows_progress_without_rich(tmp_path: Path) -> None:
    config = json.dumps({"root": str(tmp_path / "store")})
    out = kvcore_without_rich(
        "demo", "--conversations", "1", "--turns", "2", "--config", config, cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "OK: every restored byte matched" in out.stdout
    assert re.search(r"^  demo: 2/2 turns", out.stderr, re.M), out.stderr  # progress lines
    assert "rich modules loaded: []" in out.stderr, out.stderr


def test_nothing_outside_the_cli_imports_rich() -> None:
    sources = [
        *(ROOT / "kvcore").rglob("*.py"),
        *ROOT.glob("plugins/*/kv_*/**/*.py"),
        *ROOT.glob("integrations/*/kvcore_*/**/*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
        ROOT / "_kvcore_pytest.py",
    ]
    cli = ROOT / "kvcore" / "cli"
    importing = re.compile(r"^\s*(?:import rich\b|from rich\b)", re.M)
    offenders = [
        str(path.relative_to(ROOT))
        for path in sources
        if cli not in path.parents and importing.search(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, f"import rich only in kvcore/cli (the `cli` extra): {offenders}"
