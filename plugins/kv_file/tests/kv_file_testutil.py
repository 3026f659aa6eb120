"""Helpers shared by the kv_file tests and the child processes they start."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import kvcore
from kvcore import CacheLayout, HostBuffers
from kvcore.testing import payload_for

#: Objects of 64 KiB: big enough that a SIGKILL often lands inside a write.
LAYOUT = CacheLayout(num_layers=4, num_heads=4, block_size=16, head_dim=128)


def open_store(root: str, layout: CacheLayout = LAYOUT, **config: Any) -> kvcore.Backend:
    cfg = {"root": root, "rescan_interval_s": 0, **config}
    return kvcore.open_backend("file", cfg, context={"layout": layout}, strict=True)


def payload(backend: kvcore.Backend, keys: list[str], version: int = 0) -> list[np.ndarray]:
    """One array per part, row i holding block i's bytes."""
    lay = backend.context.layout
    # hex of the key: payload_for cannot encode lone surrogates, which are legal names here
    tags = [k.encode("utf-8", "surrogatepass").hex() for k in keys]
    return [
        np.stack([payload_for(t, p, lay.part_bytes(p), version) for t in tags]) for p in lay.parts
    ]


def host_for(arrays: list[np.ndarray], n: int) -> HostBuffers:
    ptrs = tuple(tuple(a.ctypes.data + i * a.shape[1] for a in arrays) for i in range(n))
    return HostBuffers(ptrs=ptrs, nbytes=tuple(a.shape[1] for a in arrays))


def write(backend: kvcore.Backend, keys: list[str], version: int = 0, timeout_s: float = 30) -> int:
    arrays = payload(backend, keys, version)
    req = backend.request("t-write", keys, host=host_for(arrays, len(keys)), timeout_s=timeout_s)
    return backend.write(req)


def read(
    backend: kvcore.Backend, keys: list[str], timeout_s: float = 30
) -> tuple[int, list[np.ndarray]]:
    lay = backend.context.layout
    arrays = [np.zeros((max(len(keys), 1), lay.part_bytes(p)), np.uint8) for p in lay.parts]
    req = backend.request("t-read", keys, host=host_for(arrays, len(keys)), timeout_s=timeout_s)
    return backend.read(req), arrays


def read_verified(backend: kvcore.Backend, keys: list[str], versions=(0,)) -> int:
    """Blocks read, after asserting each read block holds one version's exact bytes."""
    done, got = read(backend, keys)
    for i in range(done):
        for j, a in enumerate(got):
            ok = any(np.array_equal(a[i], payload(backend, [keys[i]], v)[j][0]) for v in versions)
            assert ok, f"block {i} ({keys[i]}) part {j} read back other bytes"
    return done


def object_files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kv"))


def disk_bytes(root: str) -> int:
    return sum(os.path.getsize(p) for p in object_files(root))
