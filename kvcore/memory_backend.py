"""``memory``: kvcore's in-process reference backend.

A dict of objects guarded by one lock. It is what the conformance kit is proven on, what engine
adapters' tests use when they need a backend with no setup, and the smallest complete example
of the hook contract (query, contains, read, write, remove, clear, stats). Data lives as long as the
opened backend: nothing is shared between processes or kept across a restart.
"""

from __future__ import annotations

import ctypes
import threading

from pydantic import Field

from kvcore.config import BackendConfig
from kvcore.hookspecs import hookimpl
from kvcore.requests import BlockRequest, FailureKind, Outcome, leading_run
from kvcore.schemas import BackendContext, Capabilities
from kvcore.tenants import DEFAULT_TENANT, UNKNOWN_TENANT

__all__ = ["MemoryBackend", "MemoryConfig"]


class MemoryConfig(BackendConfig):
    env_prefix = "KVCORE_MEMORY_"

    max_objects: int = Field(default=1_000_000, ge=1, description="objects kept at most")


class MemoryBackend:
    """Key-addressed, host I/O; a full store refuses new objects (it never evicts). It takes
    segmented host buffers, so a transfer manager reads into and writes from an engine's
    host-resident cache blocks directly."""

    config_model = MemoryConfig
    capabilities = Capabilities(
        addressing="key", io="host", scales=True, segmented_host=True, block_meta=True
    )

    def __init__(self, config: MemoryConfig, context: BackendContext) -> None:
        self.config = config
        self._objects: dict[str, bytes] = {}
        self._meta: dict[str, bytes] = {}  # object name -> its block's metadata, where given
        self._tenants: dict[str, str] = {}  # object name -> the tenant its write named
        self._lock = threading.Lock()

    @hookimpl
    def kvcore_query(self, request: BlockRequest) -> int:
        with self._lock:
            flags = [name in self._objects for names in request.object_names for name in names]
        return leading_run(flags, len(request.parts))

    @hookimpl
    def kvcore_contains(self, request: BlockRequest) -> list[bool]:
        with self._lock:
            return [all(name in self._objects for name in names) for names in request.object_names]

    @hookimpl
    def kvcore_read(self, request: BlockRequest) -> int:
        host = request.host
        assert host is not None  # the core sends host buffers to io="host" backends
        for i, names in enumerate(request.object_names):
            if request.expired():
                return i
            for j, name in enumerate(names):
                with self._lock:
                    data = self._objects.get(name)
                if data is None or len(data) != host.nbytes[j]:
                    return i
                offset = 0
                for ptr, size in host.segments(i, j):
                    ctypes.memmove(ptr, data[offset : offset + size], size)
                    offset += size
        return request.num_blocks

    @hookimpl
    def kvcore_write(self, request: BlockRequest) -> int:
        host = request.host
        assert host is not None
        for i, names in enumerate(request.object_names):
            if request.expired():
                return i
            for j, name in enumerate(names):
                data = b"".join(ctypes.string_at(p, n) for p, n in host.segments(i, j))
                with self._lock:
                    if name in self._objects:
                        continue
                    if len(self._objects) >= self.config.max_objects:
                        return Outcome(i, f"store full ({self.config.max_objects} objects)")
                    self._objects[name] = data
                    if request.tenant is not None:
                        self._tenants[name] = request.tenant
                    if request.block_meta is not None and request.block_meta[i]:
                        self._meta[name] = request.block_meta[i]
        return request.num_blocks

    @hookimpl
    def kvcore_describe(self, request: BlockRequest) -> list[bytes | None]:
        with self._lock:
            return [
                self._meta.get(names[0]) if names[0] in self._objects else None
                for names in request.object_names
            ]

    @hookimpl
    def kvcore_names(self) -> list[str]:
        with self._lock:
            return list(self._objects)

    @hookimpl
    def kvcore_remove(self, request: BlockRequest) -> int:
        removed = 0
        with self._lock:
            for names in request.object_names:
                found = [self._objects.pop(name, None) is not None for name in names]
                for name in names:
                    self._meta.pop(name, None)
                    self._tenants.pop(name, None)
                removed += any(found)
        return removed

    @hookimpl
    def kvcore_clear(self) -> int:
        # every object here is this opened backend's (the store lives in it), whatever names
        # its callers chose (an adapter may keep an engine's own names)
        with self._lock:
            removed = len(self._objects)
            self._objects.clear()
            self._meta.clear()
            self._tenants.clear()
        return removed

    @hookimpl
    def kvcore_clear_tenant(self, tenant: str) -> int:
        with self._lock:
            names = [name for name, owner in self._tenants.items() if owner == tenant]
            if tenant == DEFAULT_TENANT:  # objects whose writes named no tenant
                names += [name for name in self._objects if name not in self._tenants]
            if not names:
                return Outcome(
                    0,
                    f"{UNKNOWN_TENANT} {tenant!r}: it holds no object here",
                    FailureKind.UNKNOWN_TENANT,
                )
            for name in names:
                self._objects.pop(name, None)
                self._meta.pop(name, None)
                self._tenants.pop(name, None)
        return len(names)

    @hookimpl
    def kvcore_stats(self) -> dict[str, float]:
        with self._lock:
            return {"objects": len(self._objects)}
