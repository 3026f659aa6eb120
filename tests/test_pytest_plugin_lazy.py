"""kvcore's pytest plugin (the ``pytest11: kvcore`` entry point, ``_kvcore_pytest``) costs a pytest
run that does not ask for the kit nothing but two options: kvcore and the conformance kit are
imported only for ``--kvcore-backend``. Its public name, ``kvcore.testing.plugin``, is the same
plugin, also when pytest loads both.

The runs happen in subprocesses in ``tmp_path``, a directory with no pytest configuration: an
unrelated project's test run in an environment that has kvcore installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

#: an unrelated project's test file: it writes down which kvcore modules its run had imported
#: by collection time (after every plugin's pytest_configure)
PROBE = """
import sys
from pathlib import Path

loaded = sorted(m for m in sys.modules if m == "kvcore" or m.startswith("kvcore."))
Path(__file__).with_name("kvcore_modules.txt").write_text("\\n".join(loaded))


def test_one():
    assert 1 + 1 == 2
"""


def pytest_in(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "KVCORE_")) and k != "PYTHONPATH"
    }
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def is_kvcore(module: str) -> bool:
    return module == "kvcore" or module.startswith("kvcore.")


def test_a_pytest_run_without_kvcore_backend_imports_nothing_of_kvcore(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    # every installed plugin loads, kv_mooncake's pytest11 plugin (its cluster fixtures, in a
    # package that imports kvcore only when its backend is asked for) among them;
    # --kvcore-config: kvcore's plugin is loaded and its options registered
    out = pytest_in(
        tmp_path, "-X", "importtime", "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
        "--kvcore-config", "{}", "test_probe.py",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "1 test collected" in out.stdout, out.stdout
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in out.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert "_pytest.main" in imported, "no -X importtime report"  # the measure works
    assert not [m for m in imported if is_kvcore(m)], [m for m in imported if is_kvcore(m)]
    # importtime leaves out modules imported through importlib (as pytest loads plugins)
    assert (tmp_path / "kvcore_modules.txt").read_text() == ""


def collected(out: subprocess.CompletedProcess[str]) -> int:
    found = re.search(r"(\d+) tests? collected", out.stdout)
    assert out.returncode == 0 and found, out.stdout[-3000:] + out.stderr[-3000:]
    return int(found.group(1))


def test_kvcore_backend_collects_the_kit_under_either_name_and_both(tmp_path: Path) -> None:
    kit = ["-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "--kvcore-backend", "memory"]
    by_entry_point = collected(pytest_in(tmp_path, *kit))
    assert by_entry_point > 20  # the conformance kit against the memory backend
    # the public name where plugins are not loaded automatically, and beside the entry point
    # (once: its options and the kit's suite are added once)
    public = ["-p", "kvcore.testing.plugin"]
    alone = pytest_in(tmp_path, *kit, *public, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert collected(alone) == by_entry_point
    assert collected(pytest_in(tmp_path, *kit, *public)) == by_entry_point
