"""The release build (scripts/build-wheels.sh): a manylinux wheel of kvcore with the C++ swap
ops compiled, pure wheels and sdists of every other package, installed into a fresh venv with
no C/C++ compiler on PATH and used from the installed packages alone (no checkout on
``sys.path``): ``kvcore --version``, ``kvcore demo``, the conformance kit against kv_file. The
sdist installs there too, without its extensions, and runs the same on the Python fallback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import kvcore
from kvcore import fileio

ROOT = Path(__file__).resolve().parents[1]
#: what a compiler on PATH could be called
COMPILERS = ("cc", "gcc", "g++", "c++", "cpp", "clang", "clang++", "x86_64-linux-gnu-gcc",
             "x86_64-linux-gnu-g++", "x86_64-linux-gnu-cpp")  # fmt: skip


#: where the README's test command builds the release (scripts/test.sh, before the tests)
PREBUILT = ROOT / ".release"


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The built wheels and sdists, and a wheelhouse of what installing them needs: the ones
    scripts/test.sh built for this tree, else built here (which needs the package index)."""
    dist, wheelhouse = PREBUILT / "dist", PREBUILT / "wheelhouse"
    sources = [ROOT / "pyproject.toml", ROOT / "setup.py", *ROOT.glob("*/*/pyproject.toml")]
    built = list(dist.glob("kvcore-*.whl"))
    fresh = (
        built
        and wheelhouse.is_dir()
        and all(b.stat().st_mtime >= s.stat().st_mtime for b in built for s in sources)
    )
    if not fresh:
        out = tmp_path_factory.mktemp("release")
        dist, wheelhouse = out / "dist", out / "wheelhouse"
        done = subprocess.run(
            ["bash", "scripts/build-wheels.sh", str(dist), "--wheelhouse", str(wheelhouse)],
            cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dist, wheelhouse


@pytest.fixture(scope="module")
def dist(release: tuple[Path, Path]) -> Path:
    return release[0]


def without_compilers(tmp: Path) -> str:
    """A PATH of every program on this one except the compilers."""
    bin_dir = tmp / "bin-without-compilers"
    bin_dir.mkdir()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            name = entry.name
            compiler = name in COMPILERS or name.startswith(("gcc-", "g++-", "clang-", "cc1"))
            if compiler or (bin_dir / name).exists() or not os.access(entry.path, os.X_OK):
                continue
            (bin_dir / name).symlink_to(entry.path)
    return str(bin_dir)


def fresh_venv(tmp: Path) -> tuple[Path, dict[str, str]]:
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "KVCORE_"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{without_compilers(tmp)}"
    env["KVCORE_FILE_ROOT"] = str(tmp / "store")
    env["XDG_STATE_HOME"] = str(tmp / "state")
    for compiler in COMPILERS:
        assert shutil.which(compiler, path=env["PATH"]) is None, f"{compiler} is still on PATH"
    return venv, env


def run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 600):
    return subprocess.run(
        args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def pip_install(python: str, args: list[str], release: tuple[Path, Path], cwd: Path, env):
    """``pip install`` offline: from the built release and its wheelhouse only."""
    dist, wheelhouse = release
    return run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
         "--find-links", str(dist), "--find-links", str(wheelhouse), *args],
        env, cwd,
    )  # fmt: skip


def test_the_core_wheel_is_manylinux_with_the_swap_ops_and_no_tests(dist: Path) -> None:
    (wheel,) = dist.glob("kvcore-*-manylinux*.whl")
    show = subprocess.run(
        [str(ROOT / ".venv/bin/python"), "-m", "auditwheel", "show", str(wheel)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "manylinux_" in " ".join(show.stdout.split()), show.stdout
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("kvcore/_swap") and n.endswith(".so") for n in names)
    assert "kvcore/py.typed" in names and "kvcore/testing/suite.py" in names  # the kit ships
    assert "_kvcore_pytest.py" in names  # the module of the pytest11 entry point, top-level
    assert not [n for n in names if n.startswith("tests/") or "/tests/" in n or "conftest" in n]
    pure = sorted(p.name.split("-")[0] for p in dist.glob("*-py3-none-any.whl"))
    assert pure == sorted(
        [
            "kvcore_attentionstore",
            "kvcore_fastdeploy",
            "kvcore_file",
            "kvcore_lmcache",
            "kvcore_mooncake",
            "kvcore_sglang",
            "kvcore_tiered",
            "kvcore_vllm",
        ]
    )
    assert len(list(dist.glob("*.tar.gz"))) == 9
    for wheel in dist.glob("*.whl"):  # every package says it is typed
        package = wheel.name.split("-")[0].replace("kvcore_", "kv_")
        typed = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("/py.typed")]
        assert typed, f"{wheel.name} has no py.typed ({package})"


def test_installed_wheels_work_without_a_compiler_or_a_checkout(
    release: tuple[Path, Path], tmp_path
) -> None:
    venv, env = fresh_venv(tmp_path)
    python = str(venv / "bin" / "python")
    # kvcore's packages from the built wheels, their dependencies as binary wheels: nothing
    # may need compiling (and, offline, nothing may come from elsewhere)
    done = pip_install(python, ["--only-binary", ":all:", f"kvcore[file]=={kvcore.__version__}",
                                "pytest>=8"], release, tmp_path, env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    where = run([python, "-c", "import kvcore, kv_file; print(kvcore.__file__, kv_file.__file__)"],
                env, tmp_path)  # fmt: skip
    assert str(venv) in where.stdout and str(ROOT) not in where.stdout, where.stdout + where.stderr

    # the wheel's native file I/O, with no compiler on PATH; its checksums too where the
    # build had xxhash's header (scripts/install.sh installs libxxhash-dev where it may)
    native = run([python, "-c", "from kvcore import fileio; print(fileio.NATIVE_DIGESTS)"],
                 env, tmp_path)  # fmt: skip
    assert native.returncode == 0, native.stderr
    assert native.stdout.strip() == str(fileio.NATIVE_DIGESTS), native.stdout + native.stderr

    version = run([str(venv / "bin" / "kvcore"), "--version"], env, tmp_path)
    assert version.returncode == 0, version.stderr
    lines = dict(line.split() for line in version.stdout.splitlines())
    assert lines["kvcore"] == kvcore.__version__ and lines["kvcore-file"] == "0.1.0"

    demo = run([str(venv / "bin" / "kvcore"), "demo", "--conversations", "1", "--turns", "2"],
               env, tmp_path)  # fmt: skip
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "OK: every restored byte matched" in demo.stdout

    config = json.dumps({"root": str(tmp_path / "kit-store")})
    kit = run([str(venv / "bin" / "kvcore"), "check", "file", "--config", config], env, tmp_path)
    assert kit.returncode == 0, kit.stdout[-3000:] + kit.stderr[-3000:]
    assert "0 failed" in kit.stdout, kit.stdout[-2000:]


def _sdist_venv(release: tuple[Path, Path], tmp_path: Path) -> tuple[Path, dict[str, str], Path]:
    """A fresh venv with no compiler on PATH and the build tools, and kvcore's sdist."""
    venv, env = fresh_venv(tmp_path)
    done = pip_install(str(venv / "bin" / "python"), ["--only-binary", ":all:",
                       "setuptools>=77", "wheel"], release, tmp_path, env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (sdist,) = release[0].glob("kvcore-[0-9]*.tar.gz")
    return venv, env, sdist


def test_the_sdist_without_a_compiler_installs_and_runs_the_python_fallback(
    release: tuple[Path, Path], tmp_path
) -> None:
    venv, env, sdist = _sdist_venv(release, tmp_path)
    python, kvcore_bin = str(venv / "bin" / "python"), str(venv / "bin" / "kvcore")
    done = pip_install(python, ["--no-build-isolation", "-vv", str(sdist),
                                f"kvcore-file=={_file_version()}", "pytest>=8"], release,
                       tmp_path, env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the build said, in one line, what was left out and how to get it
    warned = [line for line in (done.stdout + done.stderr).splitlines()
              if "no C++ compiler on PATH" in line]  # fmt: skip
    assert warned and "KVCORE_NATIVE=1 makes this an error" in warned[0], done.stderr[-3000:]
    installed = run([python, "-c", "import kvcore, pathlib; print(pathlib.Path(kvcore.__file__)"
                     ".parent)"], env, tmp_path)  # fmt: skip
    package = Path(installed.stdout.strip())
    assert str(venv) in str(package), installed.stdout + installed.stderr
    assert not list(package.glob("*.so")), "no extension can have been built without a compiler"

    listing = run([kvcore_bin, "backends"], env, tmp_path)
    assert listing.returncode == 0, listing.stderr[-2000:]
    assert "native extensions: absent (swap ops and file I/O in Python" in listing.stdout
    assert "file I/O: Python (kvcore was built without its native extension)" in listing.stdout

    demo = run([kvcore_bin, "demo", "--conversations", "1", "--turns", "2"], env, tmp_path)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "OK: every restored byte matched" in demo.stdout

    config = json.dumps({"root": str(tmp_path / "kit-store")})
    kit = run([kvcore_bin, "check", "file", "--config", config], env, tmp_path)
    assert kit.returncode == 0, kit.stdout[-3000:] + kit.stderr[-3000:]
    assert "0 failed" in kit.stdout, kit.stdout[-2000:]


def _file_version() -> str:
    from importlib.metadata import version

    return version("kvcore-file")


def test_a_source_build_that_requires_the_extensions_fails_without_a_compiler_in_one_line(
    release: tuple[Path, Path], tmp_path
) -> None:
    venv, env, sdist = _sdist_venv(release, tmp_path)
    env["KVCORE_NATIVE"] = "1"  # a release build: the extensions or nothing
    build = run([str(venv / "bin" / "python"), "-m", "pip", "wheel", "--no-deps",
                 "--no-build-isolation", "--wheel-dir", str(tmp_path / "out"), str(sdist)],
                env, tmp_path)  # fmt: skip
    assert build.returncode != 0
    said = [line for line in (build.stdout + build.stderr).splitlines()
            if "needs a C++ compiler on PATH" in line]  # fmt: skip
    assert said, build.stdout[-3000:] + build.stderr[-3000:]
    assert "install kvcore's prebuilt wheel" in said[0]
