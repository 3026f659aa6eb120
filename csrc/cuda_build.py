"""How the CUDA swap library is built: shared by setup.py and tests/cuda/run_cuda_ops.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CSRC = Path(__file__).resolve().parent


def find_nvcc() -> str | None:
    """nvcc on PATH, else under CUDA_HOME / CUDA_PATH / /usr/local/cuda."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return shutil.which("nvcc") or shutil.which("nvcc", path=str(Path(home) / "bin"))


def nvcc_command(nvcc: str, out: str | Path) -> list[str]:
    """The compile-and-link command for ``_swap_cuda.so`` (sm_80 and sm_90), run in csrc/."""
    return [
        nvcc,
        "-O3",
        "-std=c++17",
        "-shared",
        "-Xcompiler",
        "-fPIC,-pthread",
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-I.",
        "swap_ops_cuda.cu",
        "swap_ops.cc",
        "-o",
        str(Path(out).resolve()),
    ]
