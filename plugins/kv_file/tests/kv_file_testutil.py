"""Helpers shared by the kv_file tests and the child processes they start."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import shutil
from typing import Any

import numpy as np
from kv_file.objfile import encode_name
from kv_file.paths import name_digest

import kvcore
from kvcore import CacheLayout, HostBuffers, fileio
from kvcore.replay import capacity_holding
from kvcore.testing import payload_for

#: Objects of 64 KiB: big enough that a SIGKILL often lands inside a write.
LAYOUT = CacheLayout(num_layers=4, num_heads=4, block_size=16, head_dim=128)


def open_store(
    root: str,
    layout: CacheLayout = LAYOUT,
    *,
    rank: int = 0,
    world_size: int = 1,
    context_namespace: str = "default",
    **config: Any,
) -> kvcore.Backend:
    """A strict ``file`` backend on ``root`` (no background rescans) for one engine context."""
    cfg = {"root": root, "rescan_interval_s": 0, **config}
    context = {
        "layout": layout,
        "rank": rank,
        "world_size": world_size,
        "namespace": context_namespace,
    }
    return kvcore.open_backend("file", cfg, context=context, strict=True)


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


def write(
    backend: kvcore.Backend,
    keys: list[str],
    version: int = 0,
    timeout_s: float = 30,
    tenant: str | None = None,
) -> int:
    arrays = payload(backend, keys, version)
    req = backend.request(
        "t-write", keys, host=host_for(arrays, len(keys)), timeout_s=timeout_s, tenant=tenant
    )
    return backend.write(req)


def aligned_zeros(rows: int, cols: int, offset: int = 0) -> np.ndarray:
    """Zeroed rows starting ``offset`` bytes past a page boundary, like an engine's staging
    buffer (``offset`` 0: page-aligned, so the store may read it with ``O_DIRECT``)."""
    mm = mmap.mmap(-1, rows * cols + offset + 1)
    return np.frombuffer(mm, np.uint8, count=rows * cols, offset=offset).reshape(rows, cols)


def read(
    backend: kvcore.Backend, keys: list[str], timeout_s: float = 30, offset: int = 0
) -> tuple[int, list[np.ndarray]]:
    lay = backend.context.layout
    arrays = [aligned_zeros(max(len(keys), 1), lay.part_bytes(p), offset) for p in lay.parts]
    req = backend.request("t-read", keys, host=host_for(arrays, len(keys)), timeout_s=timeout_s)
    return backend.read(req), arrays


def read_verified(backend: kvcore.Backend, keys: list[str], versions=(0,), offset: int = 0) -> int:
    """Blocks read, after asserting each read block holds one version's exact bytes."""
    done, got = read(backend, keys, offset=offset)
    for i in range(done):
        for j, a in enumerate(got):
            ok = any(np.array_equal(a[i], payload(backend, [keys[i]], v)[j][0]) for v in versions)
            assert ok, f"block {i} ({keys[i]}) part {j} read back other bytes"
    return done


def object_path(backend: kvcore.Backend, key: str, part: int = 0) -> str:
    """The file that holds part ``part`` of block ``key``."""
    name = backend.request("path", [key]).object_names[0][part]
    return backend.plugin._dir.object_path(name_digest(encode_name(name)))


def object_paths(backend: kvcore.Backend, key: str) -> list[str]:
    """The files of every part of block ``key``."""
    return [object_path(backend, key, j) for j in range(len(backend.context.layout.parts))]


def query(backend: kvcore.Backend, keys: list[str]) -> int:
    return backend.query(backend.request("t-query", keys))


def object_files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kv"))


def forget_journal(root: str, namespace: str = "default") -> None:
    """Delete a store's journal and ledger, as if an older kv_file (before 0.3) had written it
    or the journal were lost: the next open rebuilds from a scan, ordering files by mtime."""
    for name in ("journal", "ledger"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(root, namespace, name))


def disk_bytes(root: str) -> int:
    return sum(os.path.getsize(p) for p in object_files(root))


def drop_cached_pages(paths: list[str], start: int = 0, length: int = 0) -> None:
    """Evict the files' pages (``start``/``length``: a range) so the next read goes to disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_pages(path: str) -> int:
    """Pages of ``path`` in the page cache, from cachestat(2) (no I/O)."""
    stat, rng = (ctypes.c_uint64 * 5)(), (ctypes.c_uint64 * 2)()
    fd = os.open(path, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).syscall(451, fd, rng, stat, 0) != 0:
            raise OSError(ctypes.get_errno(), "cachestat")
    finally:
        os.close(fd)
    return stat[0]


def cache_first_page(path: str) -> None:
    """Bring only the first page of ``path`` into the cache (no readahead)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, mmap.PAGESIZE, 0)
    finally:
        os.close(fd)


def direct_reads_work(directory: str) -> bool:
    """Whether files in ``directory`` can be read with O_DIRECT and asked about with cachestat."""
    path = os.path.join(directory, ".direct-probe")
    with open(path, "wb") as f:
        f.write(b"\0" * mmap.PAGESIZE)
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [buf], 0)
            stat, rng = (ctypes.c_uint64 * 5)(), (ctypes.c_uint64 * 2)()
            libc = ctypes.CDLL(None, use_errno=True)
            return libc.syscall(451, fd, rng, stat, 0) == 0
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        os.unlink(path)


def with_own_files(root: str, objects_bytes: int, **config: Any) -> int:
    """A ``capacity_bytes`` that holds ``objects_bytes`` of objects in a store at ``root``:
    the capacity bounds the store's own files too (ledger, journal), whose size depends on the
    file system and, for the journal, on the capacity. Measured on a store beside ``root``."""
    probe = f"{root}.own-files-probe"
    try:
        return capacity_holding(
            lambda capacity: open_store(probe, capacity_bytes=capacity, **config), objects_bytes
        )
    finally:
        shutil.rmtree(probe, ignore_errors=True)


class _FailingBatch:
    """A native batch whose first object fails with ``code``, as one thread would run it:
    nothing is read or written, and the objects after it are not started."""

    def __init__(self, size: int, code: int) -> None:
        self.size, self._code = size, code

    def run(self) -> None:
        pass

    def results(self) -> tuple[np.ndarray, np.ndarray, int, int]:
        codes = np.full(self.size, fileio.FileRead.SKIPPED, dtype=np.int32)
        errnos = np.zeros(self.size, dtype=np.int32)
        if self.size:
            codes[0], errnos[0] = fileio.FileRead.ERRNO, self._code
        return codes, errnos, 0, 0

    def tails(self) -> np.ndarray:
        return np.zeros(self.size, dtype=np.uint64)


def fail_object_io(monkeypatch: Any, op: str, code: int) -> None:
    """Every object ``op`` (``"read"`` or ``"write"``) fails with OSError ``code`` from now on,
    on both of kv_file's paths: per object (``read_object`` / ``write_object``) and in native
    batches (the batch reports the errno for each object)."""
    import kv_file.transfer

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code))

    def failing_batch(paths: list[str], *args: Any, **kwargs: Any) -> _FailingBatch:
        return _FailingBatch(len(paths), code)

    monkeypatch.setattr(kv_file.transfer, f"{op}_object", fail)
    if op == "read":
        monkeypatch.setattr(fileio, "read_batch", failing_batch)
    else:  # write_batch(temps, paths, ...): as many objects as temps
        monkeypatch.setattr(fileio, "write_batch", failing_batch)
