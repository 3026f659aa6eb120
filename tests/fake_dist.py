"""Make throwaway backend distributions (module + .dist-info with entry points) in a temp site."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_dist(site: Path, dist: str, module: str, source: str, backends: dict[str, str]) -> None:
    """Write ``module.py`` and ``<dist>-0.1.dist-info`` declaring ``backends`` (name -> attr)."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    eps = "\n".join(f"{name} = {module}:{attr}" for name, attr in backends.items())
    (info / "entry_points.txt").write_text(f"[kvcore.backends]\n{eps}\n")


def run_python(site: Path, code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, **env}
    environ["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT / "tests")])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
    )


def run_module(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, **env}
    environ["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT / "tests")])
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
    )


GOOD_BACKEND = """
from memory_backend import MemoryBackend as Backend
"""

MISSPELLED_BACKEND = """
import kvcore
from memory_backend import MemoryBackend

class Backend(MemoryBackend):
    @kvcore.hookimpl
    def kvcore_raed(self, request):
        return 0
"""

UNDECORATED_BACKEND = """
import kvcore
from memory_backend import MemoryConfig

class Backend:
    config_model = MemoryConfig
    capabilities = kvcore.Capabilities()
    def __init__(self, config, context): pass
    def kvcore_query(self, request): return 0
    def kvcore_read(self, request): return 0
    def kvcore_write(self, request): return 0
"""

BROKEN_IMPORT_BACKEND = """
import not_installed_vendor_sdk  # noqa: F401
"""
