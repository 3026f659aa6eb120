"""Build script: dependencies that depend on the CUDA choice, and the native extensions (csrc/):
the swap ops and whole-file reads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError
from setuptools.errors import ExecError as DistutilsExecError

sys.path.insert(0, str(Path(__file__).resolve().parent / "csrc"))
import cuda_build as _cuda_build

BASE_DEPS = [
    "pluggy>=1.5",
    "pydantic>=2.6,<3",
    "numpy>=1.24",
    "importlib-metadata>=6",
    "typing-extensions>=4.6",
    "xxhash>=3",  # block digests for backends that keep no checksum
    # environment overrides of configs (errors name the variable): kvcore.schemas.EnvConfig
    "pydantic-settings>=2.3",
    # Prometheus exposition: kvcore.metrics.PrometheusCollector and serve_prometheus
    "prometheus-client>=0.20",
    # (rich, for the CLI's tables and progress bars, is the `cli` extra in pyproject.toml: the
    # CLI prints plain text without it, and nothing else uses it)
]


_YES, _NO = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _cuda_requested() -> bool:
    return os.environ.get("KVCORE_CUDA", "").strip().lower() in _YES


def _nvcc() -> str | None:
    """nvcc to build kvcore/_swap_cuda.so with, or None. KVCORE_CUDA=1 requires it, =auto uses it
    when found; anything else (the default) never calls it, so CPU installs need no CUDA."""
    choice = os.environ.get("KVCORE_CUDA", "").strip().lower()
    if not _cuda_requested() and choice != "auto":
        return None
    nvcc = _cuda_build.find_nvcc()
    if nvcc is None and _cuda_requested():
        sys.exit("KVCORE_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    return nvcc


NO_COMPILER = (
    "kvcore: building the C++ swap ops from source needs a C++ compiler on PATH ({what}); "
    "install one (e.g. `apt install g++`), or install kvcore's prebuilt wheel instead"
)
PYTHON_FALLBACK = (
    "kvcore: WARNING: no C++ compiler on PATH ({what}): installing without the native "
    "extensions. The swap ops and file I/O run in Python (correct, slower); `kvcore backends` "
    "says so. Install kvcore's prebuilt wheel, or a compiler (e.g. `apt install g++`) and "
    "reinstall, for the native path; KVCORE_NATIVE=1 makes this an error."
)


def _native_choice() -> str:
    """KVCORE_NATIVE (kvcore.native.NATIVE_ENV): "1" requires the extensions, "0" builds
    none, anything else builds them where a compiler is found."""
    choice = os.environ.get("KVCORE_NATIVE", "").strip().lower()
    return "require" if choice in _YES else "none" if choice in _NO else "auto"


def _compilers_missing() -> str | None:
    """The compilers this build would run that are not on PATH (None: all are there)."""
    names = []
    for var in ("CC", "CXX"):
        command = os.environ.get(var) or sysconfig.get_config_var(var) or ""
        if command.split():
            names.append(command.split()[0])
    missing = [n for n in dict.fromkeys(names) if shutil.which(n) is None]
    return ", ".join(f"{n!r} not found" for n in missing) or None


class BuildExtWithCuda(build_ext):
    """Builds kvcore._swap and kvcore._fileio, then (if requested) the ctypes-loaded CUDA
    library beside them; without a compiler, nothing (unless KVCORE_NATIVE=1 requires it)."""

    def run(self) -> None:
        choice = _native_choice()
        if choice == "none":  # kvcore.native finds no extension and takes the Python path
            print("kvcore: KVCORE_NATIVE=0: installing without the native extensions (the swap "
                  "ops and file I/O run in Python)", file=sys.stderr, flush=True)  # fmt: skip
            return
        missing = _compilers_missing()
        if missing and choice == "require":
            sys.exit(NO_COMPILER.format(what=missing))
        if missing:
            # kvcore.native finds no extension at run time and takes the Python path
            print(PYTHON_FALLBACK.format(what=missing), file=sys.stderr, flush=True)
            return
        try:
            super().run()
        except (CCompilerError, DistutilsExecError) as exc:
            sys.exit(NO_COMPILER.format(what=str(exc).splitlines()[0]))
        nvcc = _nvcc()
        if nvcc is None:
            return
        out = Path(self.get_ext_fullpath("kvcore._swap")).parent / "_swap_cuda.so"
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = _cuda_build.nvcc_command(nvcc, out)
        self.announce(" ".join(cmd), level=2)
        subprocess.check_call(cmd, cwd=_cuda_build.CSRC)


swap_ext = Extension(
    "kvcore._swap",
    sources=["csrc/_swap_module.cc", "csrc/swap_ops.cc"],
    include_dirs=["csrc"],
    depends=["csrc/swap_ops.h"],
    extra_compile_args=["-O3", "-std=c++17", "-pthread"],
    extra_link_args=["-pthread"],
    language="c++",
)

# Native whole-file reads for file backends (kvcore.fileio). xxhash's header (the
# libxxhash-dev package, or any xxhash.h on the include path) compiles xxh3 in, so the
# library needs no libxxhash at run time; without it the reads still work and the caller
# hashes the payload itself.
fileio_ext = Extension(
    "kvcore._fileio",
    sources=[
        "csrc/_fileio_module.cc",
        "csrc/file_ops.cc",
        "csrc/file_batch.cc",
        "csrc/digest_avx2.cc",
        "csrc/digest_avx512.cc",
    ],
    include_dirs=["csrc"],
    depends=["csrc/file_ops.h", "csrc/digest_kernel.inc", "csrc/thread_buffer.h"],
    extra_compile_args=["-O3", "-std=c++17"],
    language="c++",
)

setup(
    install_requires=BASE_DEPS,
    ext_modules=[swap_ext, fileio_ext],
    cmdclass={"build_ext": BuildExtWithCuda},
)
