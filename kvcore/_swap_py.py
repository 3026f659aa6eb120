"""The swap ops in Python, for an install built without a C++ compiler (see :mod:`kvcore.native`).

Same functions, arguments, checks and error messages as the C++ extension ``kvcore._swap``
(``csrc/swap_ops.cc``), so :mod:`kvcore.ops` calls either the same way and the tests run on
both. Every id is checked before any byte moves; runs consecutive on both sides are one copy.
The copies are ``ctypes.memmove`` on the calling thread: correct and byte-exact, not fast (the
requested thread count is resolved as the extension resolves it, then not used).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np
import numpy.typing as npt

TO_HOST = 0
TO_DEVICE = 1

_SMALL_COPY_BYTES = 1 << 20  # below this the extension uses one thread
_MIN_CHUNK_BYTES = 4096
_MAX_THREADS = 64


def _int64s(values: Any, name: str, dtype: type = np.int64) -> npt.NDArray[Any]:
    """A 1-D buffer of 8-byte integers, as the extension accepts it."""
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.dtype.itemsize != 8:
        raise TypeError(f"{name} must be a 1-D buffer of 8-byte integers")
    return arr.astype(dtype, copy=False)


def resolve_threads(requested: int, total_bytes: int, /) -> int:
    n = int(requested)
    if n <= 0:
        try:
            n = int(os.environ.get("KVCORE_SWAP_THREADS", "0") or 0)
        except ValueError:
            n = 0
        if n <= 0:
            n = min(4, os.cpu_count() or 1)
        if total_bytes < _SMALL_COPY_BYTES:
            n = 1
    return int(min(n, max(1, total_bytes // _MIN_CHUNK_BYTES), _MAX_THREADS))


def _check_ids(
    dev_nblocks: npt.NDArray[np.int64],
    dev_ids: npt.NDArray[np.int64],
    other_ids: npt.NDArray[np.int64],
    other_limit: int,
    other_name: str,
    mode: int,
) -> None:
    if mode not in (TO_HOST, TO_DEVICE):
        raise ValueError(f"mode must be 0 (to host) or 1 (to device), got {mode}")
    if len(dev_ids) == 0:
        return
    dev_limit = int(dev_nblocks.min()) if len(dev_nblocks) else np.iinfo(np.int64).max
    dev_bad = (dev_ids < 0) | (dev_ids >= dev_limit)
    other_bad = (other_ids < 0) | ((other_ids >= other_limit) if other_limit >= 0 else False)
    bad = np.flatnonzero(dev_bad | other_bad)
    if len(bad):  # the first bad pair, its device id first, as the extension reports it
        i = int(bad[0])
        d, o = int(dev_ids[i]), int(other_ids[i])
        if dev_bad[i]:
            layer = 0
            while layer < len(dev_nblocks) and 0 <= d < dev_nblocks[layer]:
                layer += 1
            limit = int(dev_nblocks[0] if d < 0 else dev_nblocks[layer])
            raise ValueError(
                f"device_block_ids[{i}]={d} out of range [0, {limit}) of layer {layer}"
            )
        if other_limit >= 0:
            raise ValueError(f"{other_name}[{i}]={o} out of range [0, {other_limit})")
        raise ValueError(f"{other_name}[{i}]={o} is negative")
    dst = other_ids if mode == TO_HOST else dev_ids
    ordered = np.sort(dst)
    repeats = np.flatnonzero(ordered[1:] == ordered[:-1])
    if len(repeats):
        name = other_name if mode == TO_HOST else "device_block_ids"
        raise ValueError(
            f"{name} contains duplicate destination id {int(ordered[repeats[0]])} "
            f"(mode {mode} writes to it twice)"
        )


def _runs(
    dev_ids: npt.NDArray[np.int64], other_ids: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(first index, length) of each run where both id lists advance by one."""
    n = len(dev_ids)
    joined = (np.diff(dev_ids) == 1) & (np.diff(other_ids) == 1)
    starts = np.concatenate(([0], np.flatnonzero(~joined) + 1)).astype(np.int64)
    lengths = np.diff(np.append(starts, n))
    return starts, lengths


def swap_all_layers(
    dev_ptrs: Any,
    host_ptrs: Any,
    dev_nblocks: Any,
    block_bytes: int,
    host_nblocks: int,
    dev_ids: Any,
    host_ids: Any,
    mode: int,
    nthreads: int,
    /,
) -> None:
    devs = _int64s(dev_ptrs, "dev_ptrs", np.uint64)
    hosts = _int64s(host_ptrs, "host_ptrs", np.uint64)
    nblocks = _int64s(dev_nblocks, "dev_nblocks")
    dids = _int64s(dev_ids, "device_block_ids")
    hids = _int64s(host_ids, "host_block_ids")
    if not len(devs) == len(hosts) == len(nblocks):
        raise ValueError("dev_ptrs, host_ptrs and dev_nblocks differ in length")
    if len(dids) != len(hids):
        raise ValueError("device_block_ids and host_block_ids differ in length")
    if block_bytes <= 0:
        raise ValueError(f"block size must be positive, got {block_bytes} bytes")
    if host_nblocks < 0:
        raise ValueError(f"max_host_blocks must be >= 0, got {host_nblocks}")
    _check_ids(nblocks, dids, hids, host_nblocks, "host_block_ids", mode)
    if len(dids) == 0 or len(devs) == 0:
        return
    for layer in range(len(devs)):
        if devs[layer] == 0 or hosts[layer] == 0:
            raise ValueError(f"null pointer for layer {layer}")
    starts, lengths = _runs(dids, hids)
    for layer in range(len(devs)):
        dev, host = int(devs[layer]), int(hosts[layer])
        for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
            d = dev + int(dids[start]) * block_bytes
            h = host + int(hids[start]) * block_bytes
            dst, src = (h, d) if mode == TO_HOST else (d, h)
            ctypes.memmove(dst, src, length * block_bytes)


def swap_layout(
    layer_ptrs: Any,
    layer_nblocks: Any,
    block_bytes: int,
    staging: int,
    staging_nslots: int,
    dev_ids: Any,
    slot_ids: Any,
    mode: int,
    nthreads: int,
    /,
) -> None:
    ptrs = _int64s(layer_ptrs, "layer_ptrs", np.uint64)
    nblocks = _int64s(layer_nblocks, "layer_nblocks")
    dids = _int64s(dev_ids, "device_block_ids")
    sids = _int64s(slot_ids, "staging_slot_ids")
    if len(ptrs) != len(nblocks):
        raise ValueError("layer_ptrs and layer_nblocks differ in length")
    if len(dids) != len(sids):
        raise ValueError("device_block_ids and staging_slot_ids differ in length")
    if block_bytes <= 0:
        raise ValueError(f"block size must be positive, got {block_bytes} bytes")
    _check_ids(nblocks, dids, sids, staging_nslots, "staging_slot_ids", mode)
    nlayers = len(ptrs)
    if len(dids) == 0 or nlayers == 0:
        return
    if staging == 0:
        raise ValueError("staging_ptr is null")
    for layer in range(nlayers):
        if ptrs[layer] == 0:
            raise ValueError(f"null pointer for layer {layer}")
    slot_bytes = block_bytes * nlayers
    # a slot holds one block of every layer: runs merge only when there is a single layer
    if nlayers == 1:
        starts, lengths = _runs(dids, sids)
    else:
        starts, lengths = np.arange(len(dids)), np.ones(len(dids), dtype=np.int64)
    for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
        for layer in range(nlayers):
            d = int(ptrs[layer]) + int(dids[start]) * block_bytes
            s = int(staging) + int(sids[start]) * slot_bytes + layer * block_bytes
            dst, src = (s, d) if mode == TO_HOST else (d, s)
            ctypes.memmove(dst, src, length * block_bytes)
