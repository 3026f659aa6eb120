"""``KVCoreStoragePlugin``: LMCache's in-process storage plugin served by any kvcore backend.

For LMCache users not yet on the multiprocess server: LMCache's engine config names it as a
storage plugin, and the plugin's own settings sit beside its loader keys::

    storage_plugins: ["kvcore"]
    extra_config:
      storage_plugin.kvcore.module_path: kvcore_lmcache.plugin
      storage_plugin.kvcore.class_name: KVCoreStoragePlugin
      storage_plugin.kvcore.backend: file
      storage_plugin.kvcore.backend_config: {"root": "/nvme/kvcore"}

(any key of :class:`kvcore_lmcache.settings.AdapterSettings` after
``storage_plugin.<name>.``). A chunk is one kvcore object named by every field of LMCache's
``CacheEngineKey`` (model, world size, worker id, chunk hash, KV dtype, tags), stored with its
layout (shape, dtype, memory format), from which a read allocates its buffer in LMCache's
local CPU backend and against which the bytes read are checked. Puts run on the plugin's own
threads; every failure is a miss (False, None), logged once per kind and counted.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any
from urllib.parse import quote

import torch
from lmcache.utils import STR_DTYPE_TO_TORCH_DTYPE, CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

import kvcore
from kvcore_lmcache.layouts import layout_of, parse_layout
from kvcore_lmcache.settings import AdapterSettings
from kvcore_lmcache.store import Store

__all__ = ["CHUNK_PART", "KVCoreStoragePlugin", "chunk_key"]

#: The part each chunk is stored as (MP mode's objects are ``obj``: the two never meet).
CHUNK_PART = "chunk"
_LOADER_KEYS = ("module_path", "class_name")


#: the key tag naming a request's tenant (LMCache's ``lmcache.tag.kvcore_tenant`` request config)
TENANT_TAG = "kvcore_tenant"


def chunk_key(key: CacheEngineKey) -> str:
    """The kvcore block key of an in-process LMCache key: every field LMCache compares keys by
    (model, world size, worker id, chunk hash, dtype, tags), each unambiguous."""
    text = ",".join(
        [
            key.chunk_hash_hex,
            str(key.world_size),
            str(key.worker_id),
            str(key.dtype).removeprefix("torch."),
            quote(key.model_name, safe=""),
        ]
    )
    if key.tags:
        text += "," + quote(json.dumps([list(tag) for tag in key.tags]), safe="")
    return text


def plugin_settings(extra_config: dict[str, Any] | None, cls_name: str) -> AdapterSettings:
    """This plugin's settings from LMCache's ``extra_config``: the keys after
    ``storage_plugin.<name>.`` for the one ``<name>`` whose ``class_name`` is this class.

    :raises ValueError: naming the bad key, or when zero or several names load this class.
    """
    extra = extra_config or {}
    names = {
        key.split(".")[1]
        for key, value in extra.items()
        if key.startswith("storage_plugin.") and key.endswith(".class_name") and value == cls_name
    }
    if len(names) != 1:
        raise ValueError(
            f"lmcache extra_config: {len(names)} storage plugins name class {cls_name!r} "
            f"({sorted(names)}); kvcore's plugin reads its settings from exactly one"
        )
    (name,) = names
    prefix = f"storage_plugin.{name}."
    params = {
        key[len(prefix) :]: value
        for key, value in extra.items()
        if key.startswith(prefix) and key[len(prefix) :] not in _LOADER_KEYS
    }
    return AdapterSettings.from_params(params, f"lmcache extra_config {prefix}*")


class KVCoreStoragePlugin(StoragePluginInterface):
    """LMCache's ``StoragePluginInterface`` over the kvcore backend its settings name."""

    def __init__(
        self,
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: Any = None,
        dst_device: str = "cpu",
    ) -> None:
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        self.settings = self._settings(getattr(config, "extra_config", None))
        self._kv = Store(self.settings)
        self._lock = threading.Lock()
        self._in_flight: set[CacheEngineKey] = set()
        self._pins: dict[CacheEngineKey, int] = {}
        #: every lookup, get, put and removal runs here (kvcore's one host path)
        self._runner = self._kv.runner
        backend = self._kv.backend()  # now if it can (a store that is not up: tried again)
        if backend is not None and not backend.capabilities.block_meta:
            self.close()
            raise ValueError(
                f"lmcache storage plugin for kvcore: backend {self.settings.backend!r} keeps no "
                "block metadata, and a get allocates its buffer from the chunk's stored layout; "
                "use a backend that keeps it (file, or a tiered stack whose first tier does)"
            )

    def _settings(self, extra_config: dict[str, Any] | None) -> AdapterSettings:
        """This plugin's settings (:func:`plugin_settings`); a subclass may supply its own."""
        return plugin_settings(extra_config, type(self).__name__)

    def __str__(self) -> str:
        return "KVCoreStoragePlugin"

    @property
    def backend(self) -> kvcore.Backend | None:
        """The kvcore backend if it is open now (never opens it)."""
        return self._kv.opened

    def _request(
        self,
        backend: kvcore.Backend,
        keys: Sequence[CacheEngineKey],
        objs: Sequence[MemoryObj] | None = None,
        meta: Sequence[bytes] | None = None,
    ) -> kvcore.BlockRequest:
        host = None
        size = None
        if objs is not None:
            size = objs[0].get_size()
            host = kvcore.HostBuffers(ptrs=tuple((o.data_ptr,) for o in objs), nbytes=(size,))
        return backend.request(
            "lmcache-plugin",
            [chunk_key(k) for k in keys],
            timeout_s=self.settings.timeout_s,
            host=host,
            parts=(CHUNK_PART,),
            part_bytes=None if size is None else (size,),
            block_meta=meta,
            tenant=self._tenant_of(keys),
        )

    def _tenant_of(self, keys: Sequence[CacheEngineKey]) -> str | None:
        """The tenant of a batch's request: the ``kvcore_tenant`` tag LMCache keys carry from
        a request's ``lmcache.tag.kvcore_tenant`` config (one request's keys share their
        tags), else the settings' default tenant (None: no tenants set)."""
        tags = dict(keys[0].tags or ()) if keys else {}
        named = tags.get(TENANT_TAG)
        return self.settings.tenant_of(tenant=named if isinstance(named, str) else None)

    # -- lookups -----------------------------------------------------------------------------

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """Leading chunks of ``keys`` stored (one backend call); pins them when asked."""

        def ask() -> int:
            if not keys:
                return 0
            found = self._runner.lookup(partial(self._request, keys=keys), blocks=len(keys))
            # found, unless reading them is expected to take longer than computing them
            n = self._kv.worth_loading(
                found.leading, *self._chunk_cost(), probe=partial(self._request, keys=keys)
            )
            if pin:
                for key in keys[:n]:
                    self.pin(key)
            return n

        return self._kv.guard("contains", 0, ask)

    def _chunk_cost(self) -> tuple[int | None, int | None]:
        """Bytes and tokens of one full chunk, from LMCache's metadata (None: unknown)."""
        meta = self.metadata
        shape, dtype = getattr(meta, "kv_shape", None), getattr(meta, "kv_dtype", None)
        if not shape or dtype is None:
            return None, None
        return math.prod(shape) * dtype.itemsize, int(meta.chunk_size)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._in_flight

    # -- puts --------------------------------------------------------------------------------

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future[Any]] | None:
        """Store ``objs`` under ``keys`` as a task of the runner's (each object referenced until
        it is written); ``on_complete_callback(key)`` for each key stored."""
        with self._lock:
            todo = [(k, o) for k, o in zip(keys, objs, strict=True) if k not in self._in_flight]
            self._in_flight.update(k for k, _ in todo)
        if not todo:
            return None
        for _, obj in todo:
            obj.ref_count_up()
        future: Future[Any] = Future()
        keys_in = [k for k, _ in todo]
        objs_in = [o for _, o in todo]
        runs: dict[int, list[int]] = {}
        for i, obj in enumerate(objs_in):  # one request per object size
            runs.setdefault(obj.get_size(), []).append(i)
        order = [i for indices in runs.values() for i in indices]

        def build(backend: kvcore.Backend) -> list[kvcore.BlockRequest]:
            checks = self._kv.checks_layout(backend)
            requests = []
            for indices in runs.values():
                objs = [objs_in[i] for i in indices]
                meta = [layout_of(o) for o in objs] if checks else None
                requests.append(self._request(backend, [keys_in[i] for i in indices], objs, meta))
            return requests

        def done(result: kvcore.HostResult) -> None:
            stored = [keys_in[i] for i, ok in zip(order, result.done, strict=True) if ok]
            with self._lock:
                self._in_flight.difference_update(keys_in)
            for obj in objs_in:
                obj.ref_count_down()
            if on_complete_callback is not None:
                callback = on_complete_callback
                for key in stored:  # the caller's failure is logged once, never the put's
                    self._kv.guard("put_callback", None, partial(callback, key))
            future.set_result(None)

        # each chunk on its own, the store's admission first (a refused chunk is not written)
        self._runner.submit_write(build, blocks=len(todo), each=True, on_done=done)
        return [future]

    # -- gets --------------------------------------------------------------------------------

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        """The chunk read into a buffer of its stored layout, allocated from LMCache's local
        CPU backend; None when absent, unreadable, corrupt or not of ``key``'s dtype."""
        return self._kv.guard("get", None, lambda: self._get(key))

    def _get(self, key: CacheEngineKey) -> MemoryObj | None:
        backend = self._kv.backend()
        allocator = self.local_cpu_backend
        if backend is None or allocator is None:
            self._kv.counters.add("get_unavailable")
            return None
        if not self._kv.checks_layout(backend):
            # nothing tells a buffer's shape but the stored layout: without it, no read
            self._kv.counters.add("get_without_layout")
            return None
        (meta,) = backend.describe(self._request(backend, [key]))
        layout = parse_layout(meta)
        if layout is None:
            return None
        dtypes = [STR_DTYPE_TO_TORCH_DTYPE.get(d) or getattr(torch, d, None) for d in layout.dtypes]
        if (
            any(not isinstance(d, torch.dtype) for d in dtypes)
            or layout.fmt not in MemoryFormat.__members__
        ):
            self._kv.counters.add("get_unknown_layout")
            return None
        if key.dtype not in dtypes:
            self._kv.counters.add("get_layout_mismatches")  # never read as another dtype
            return None
        shapes = [torch.Size(s) for s in layout.shapes]
        fmt = MemoryFormat[layout.fmt]
        obj = allocator.allocate(
            shapes if len(shapes) > 1 else shapes[0],
            dtypes if len(dtypes) > 1 else dtypes[0],
            fmt=fmt,
        )
        if obj is None:
            self._kv.counters.add("get_no_memory")
            return None
        if obj.get_size() != layout.size or layout_of(obj) != meta:
            obj.ref_count_down()
            self._kv.counters.add("get_layout_mismatches")
            return None
        if self._runner.read(self._request(backend, [key], [obj])).count != 1:
            obj.ref_count_down()
            return None
        return obj

    # -- pins, removal, close -----------------------------------------------------------------

    def pin(self, key: CacheEngineKey) -> bool:
        """Kept from LMCache's own removals (not ``force``) until unpinned; the backend's own
        eviction can still take it (a later get is then a miss)."""
        with self._lock:
            self._pins[key] = self._pins.get(key, 0) + 1
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        with self._lock:
            count = self._pins.get(key, 0)
            if count <= 1:
                self._pins.pop(key, None)
            else:
                self._pins[key] = count - 1
            return count > 0

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        with self._lock:
            if self._pins.get(key) and not force:
                return False

        removed = self._runner.remove(partial(self._request, keys=[key]), blocks=1)
        return removed.count == 1

    def get_allocator_backend(self) -> Any:
        if self.local_cpu_backend is None:
            raise RuntimeError("kvcore's LMCache plugin needs LMCache's local CPU backend")
        return self.local_cpu_backend

    def report_status(self) -> dict[str, Any]:
        return {"type": "KVCoreStoragePlugin", **self._kv.status()}

    def close(self) -> None:
        if self._kv.closed:
            return
        self._runner.close(finish_queued=True)  # every put queued is stored first
        self._kv.close()
