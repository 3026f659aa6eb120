"""The optional CUDA swap library (``kvcore/_swap_cuda.so``, see csrc/swap_ops_cuda.h): found,
loaded once per process, and asked whether a device is usable.

The host-memory allocator (:mod:`kvcore.host_memory`) and the swap ops (:mod:`kvcore.ops`) both
use it; neither needs the other.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["CudaLib", "cuda_available", "load_cuda_lib", "require_cuda"]

#: the library's return code for a caller's mistake (ValueError); anything else is RuntimeError
_EINVAL = 1


class CudaLib:
    """ctypes wrapper of kvcore/_swap_cuda.so (see csrc/swap_ops_cuda.h)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lib = lib = ctypes.CDLL(path)
        p, i64, i32, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64
        err = [ctypes.c_char_p, i32]
        # (device, stream, ptr arrays..., nlayers, block_bytes, limit, [staging,] ids, n, mode, sync)
        all_layers = [i32, u64, p, p, p, i32, i64, i64, p, p, i64, i32, i32, *err]
        layout = [i32, u64, p, p, i32, i64, u64, i64, p, p, i64, i32, i32, *err]
        sigs: dict[str, list[Any]] = {
            "kvc_cuda_device_count": [ctypes.POINTER(i32), *err],
            "kvc_cuda_host_alloc": [i64, ctypes.POINTER(u64), *err],
            "kvc_cuda_host_free": [u64, *err],
            "kvc_cuda_swap_all_layers": all_layers,
            "kvc_cuda_swap_layout": layout,
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, i32

    def call(self, name: str, *args: Any) -> None:
        err = ctypes.create_string_buffer(512)
        rc = getattr(self.lib, name)(*args, err, len(err))
        if rc != 0:
            msg = err.value.decode(errors="replace")
            raise (ValueError if rc == _EINVAL else RuntimeError)(msg)

    def device_count(self) -> int:
        count = ctypes.c_int(0)
        self.call("kvc_cuda_device_count", ctypes.byref(count))
        return count.value


_cuda_lock = threading.Lock()
_cuda_state: dict[str, Any] = {}


def load_cuda_lib() -> CudaLib | None:
    """The CUDA library if it was built (or KVCORE_CUDA_LIB points at one), loaded once."""
    with _cuda_lock:
        if "lib" not in _cuda_state:
            path = os.environ.get("KVCORE_CUDA_LIB") or str(
                Path(__file__).with_name("_swap_cuda.so")
            )
            lib = None
            if os.path.exists(path):
                try:
                    lib = CudaLib(path)
                except OSError as exc:
                    _cuda_state["load_error"] = f"{path}: {exc}"
            else:
                _cuda_state["load_error"] = (
                    f"{path} not built (reinstall with KVCORE_CUDA=1 or KVCORE_CUDA=auto)"
                )
            _cuda_state["lib"] = lib
        return _cuda_state["lib"]


def cuda_available() -> bool:
    """True when the CUDA library is built and loadable and at least one device is usable."""
    lib = load_cuda_lib()
    if lib is None:
        return False
    try:
        return lib.device_count() > 0
    except RuntimeError:  # e.g. error 35 on a machine with the toolkit but no driver
        return False


def require_cuda() -> CudaLib:
    lib = load_cuda_lib()
    if lib is None:
        raise RuntimeError(
            f"GPU tensors need the CUDA swap library: {_cuda_state.get('load_error', '')}"
        )
    return lib
