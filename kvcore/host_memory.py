"""Host memory for swap targets and staging: pinned through the CUDA library where a device is
present, else page-aligned ordinary memory (:class:`HostBuffer`)."""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcore.cuda_lib import CudaLib, cuda_available, require_cuda

__all__ = ["PAGE_SIZE", "HostBuffer"]

PAGE_SIZE = 4096


class _PinnedOwner:
    """Frees pinned memory once the last numpy view of it is gone (it hangs off the view base)."""

    def __init__(self, lib: CudaLib, ptr: int) -> None:
        self.lib, self.ptr = lib, ptr

    def __del__(self) -> None:
        # At interpreter shutdown the library may already be gone: nothing sensible left to do.
        with contextlib.suppress(Exception):
            self.lib.call("kvc_cuda_host_free", self.ptr)


class HostBuffer:
    """Host memory for swap targets: pinned (cudaHostAlloc) or page-aligned ordinary memory.

    ``pinned="auto"`` pins when the CUDA library is built and a device is present. The memory is
    owned by the base object of ``.array``: ``close()`` only drops this buffer's reference, so it
    is never freed while a numpy view is alive.
    """

    def __init__(self, nbytes: int, pinned: bool | str = "auto") -> None:
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        if pinned == "auto":
            pinned = cuda_available()
        elif not isinstance(pinned, bool):
            raise ValueError(f"pinned must be True, False or 'auto', got {pinned!r}")
        if pinned:
            lib = require_cuda()
            ptr = ctypes.c_uint64(0)
            lib.call("kvc_cuda_host_alloc", nbytes, ctypes.byref(ptr))
            raw = (ctypes.c_uint8 * nbytes).from_address(ptr.value)
            # the array carries its allocation's owner (ctypes arrays take new attributes)
            raw._kvcore_owner = _PinnedOwner(lib, ptr.value)  # type: ignore[attr-defined]
            # ctypes arrays export the buffer protocol; numpy's stubs accept them from 3.12 only
            pinned_array = np.frombuffer(raw, dtype=np.uint8)  # type: ignore[call-overload]
            self._array: np.ndarray | None = pinned_array
        else:
            raw_np = np.empty(nbytes + PAGE_SIZE, dtype=np.uint8)
            start = -raw_np.ctypes.data % PAGE_SIZE
            self._array = raw_np[start : start + nbytes]
        self.pinned: bool = pinned
        self.nbytes: int = nbytes

    @property
    def array(self) -> np.ndarray:
        """The whole buffer as a 1-D uint8 array (keeps the memory alive)."""
        if self._array is None:
            raise ValueError("HostBuffer is closed")
        return self._array

    @property
    def ptr(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def closed(self) -> bool:
        return self._array is None

    def view(self, dtype: Any, shape: Sequence[int] | None = None) -> np.ndarray:
        """A typed view of the first prod(shape) elements (the whole buffer if shape is None)."""
        dt = np.dtype(dtype)
        count = self.nbytes // dt.itemsize if shape is None else math.prod(shape)
        if count * dt.itemsize > self.nbytes:
            raise ValueError(f"{count} x {dt} does not fit in {self.nbytes} bytes")
        out = self.array[: count * dt.itemsize].view(dt)
        return out if shape is None else out.reshape(tuple(shape))

    def close(self) -> None:
        self._array = None

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else hex(self.ptr)
        return f"HostBuffer(nbytes={self.nbytes}, pinned={self.pinned}, {state})"
