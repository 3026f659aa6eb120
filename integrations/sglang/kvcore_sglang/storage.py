"""``KVCoreHiCacheStorage``: SGLang's HiCache storage tier served by any kvcore backend.

SGLang builds it from ``--hicache-storage-backend dynamic`` and an extra config naming this
class (see README.md), registers its host KV pool, and from then on calls the storage API from
its prefetch and backup threads. Every call here answers SGLang with a well-formed result: a
backend failure, a closed backend or a bad argument is a miss (``0``, ``False``, ``None``),
logged once per kind and counted in :meth:`KVCoreHiCacheStorage.get_stats`, never an exception
into a storage thread. Only construction and pool registration raise (they run when the
operator attaches the backend, and should fail loudly there).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

import kvcore
from kvcore.registry import load_backend_class
from kvcore_sglang.pages import (
    PageFormat,
    describe_pool,
    kv_cache_layout,
    page_buffers,
    pointer_buffers,
    tensor_buffers,
)
from kvcore_sglang.settings import StorageIdentity, StorageSettings

__all__ = ["KVCoreHiCacheStorage"]

log = logging.getLogger("kvcore_sglang")

T = TypeVar("T")

#: Part names of a KV page: MHA stores K and V, MLA one latent row per token.
MHA_PARTS = ("k", "v")
MLA_PARTS = ("kv",)
#: Host layouts whose pages are K/V (or latent) parts, one region each or one per layer.
KV_LAYOUTS = ("page_first", "page_first_direct", "page_head", "layer_first")


class StoreUnavailable(RuntimeError):
    """The backend is not open (it failed to open and is tried again on schedule)."""


class _Tier:
    """One kvcore backend (by handle: opened when it can be, reopened on kvcore's schedule)
    and the identity its objects are named with."""

    def __init__(self, namespace: str, rank: int, world_size: int) -> None:
        self.namespace = namespace
        self.rank = rank
        self.world_size = world_size
        self.handle: kvcore.BackendHandle | None = None
        self.registered: list[int] = []

    @property
    def backend(self) -> kvcore.Backend:
        """The opened backend. :raises StoreUnavailable: it cannot be opened now (a miss)."""
        assert self.handle is not None
        backend = self.handle.get()
        if backend is None:
            raise StoreUnavailable(
                f"the kvcore backend of namespace {self.namespace!r} is not open"
            )
        return backend


class KVCoreHiCacheStorage(HiCacheStorage):
    """A HiCache storage backend that stores SGLang pages in a kvcore backend.

    :param storage_config: SGLang's ``HiCacheStorageConfig``; its ``extra_config`` carries
        ``backend`` (a kvcore backend name), ``backend_config`` and the optional keys of
        :class:`kvcore_sglang.settings.StorageSettings`.
    :param kwargs: what SGLang's factory passes to dynamic backends (unused).
    """

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        self.storage_config = storage_config
        extra = storage_config.extra_config or {}
        self.settings = StorageSettings.from_extra_config(extra)
        config = self.settings.backend_config
        if isinstance(config, dict) and "namespace" in config:
            raise ValueError(
                "hicache storage extra config for kvcore: backend_config.namespace: set "
                "'namespace' at the top level of the extra config instead (the adapter adds "
                "the page format and the rank's identity to it)"
            )
        self.identity = StorageIdentity.from_storage_config(storage_config, self.settings)
        # an unknown or broken backend fails the attach now, not the first prefetch
        load_backend_class(self.settings.backend)
        if not extra.get("interface_v1"):
            log.warning(
                'kvcore storage: extra config has no "interface_v1": 1, so SGLang copies '
                "every page through batch_get/batch_set; add it for zero-copy I/O"
            )
        self.registered_pools: dict[Any, Any] = {}
        # SGLang's PoolName is a str Enum whose hash is its member name's: look pools up by value
        self._pools: dict[str, Any] = {}
        self._kv: _Tier | None = None
        self._kv_format: PageFormat | None = None
        self._kv_layout: kvcore.CacheLayout | None = None
        self._side: _Tier | None = None
        self._side_formats: dict[str, PageFormat] = {}
        self._counters = kvcore.Counters()
        self._failures = kvcore.OnceLogger(log)
        self._lock = threading.Lock()
        self._tasks = itertools.count()
        self._events: Any = None  # a StorageEventPublisher, with events_endpoint set
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        self._closed = False

    # -- pools -----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Describe the host KV pool's pages and open the kvcore backend for them.

        Raises (SGLang's attach then fails with the message) when the pool's pages cannot be
        described through ``get_page_buffer_meta`` or the backend's settings are wrong. A
        backend that cannot be opened now (a store that is not up) does not fail the attach:
        every call is a miss until it opens, tried every ``reopen_interval_s``.
        """
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", True) is None:
            raise NotImplementedError(
                f"{type(mem_pool_host).__name__} holds no KV bytes (a logical anchor pool); "
                "kvcore storage needs a materialised host KV pool"
            )
        layout_name = getattr(mem_pool_host, "layout", None)
        if layout_name not in KV_LAYOUTS:
            raise NotImplementedError(
                f"kvcore storage does not store the {layout_name!r} host layout; use one of "
                f"{', '.join(KV_LAYOUTS)} (--hicache-mem-layout)"
            )
        parts = MLA_PARTS if self.identity.is_mla else MHA_PARTS
        kind = "mla" if self.identity.is_mla else "mha"
        fmt = describe_pool(mem_pool_host, parts, kind)
        if (fmt.segments > 1) != (layout_name == "layer_first"):
            raise NotImplementedError(
                f"{type(mem_pool_host).__name__} ({layout_name}) describes a page as "
                f"{fmt.regions} regions, not as the {len(parts)} part(s) {parts} kvcore stores"
            )
        layout = None if self.identity.is_mla else kv_cache_layout(mem_pool_host, fmt)
        if self._kv is not None:
            self._close_tier(self._kv)

        def attach(backend: kvcore.Backend) -> None:  # each time the backend opens
            self._register_memory(tier, backend, mem_pool_host)
            self._start_events(backend, fmt)

        namespace = self.identity.kv_namespace(fmt.tag)
        self._kv = tier = self._open(namespace, layout, attach)
        self._kv_format, self._kv_layout = fmt, layout
        self._pools.setdefault(str(PoolName.KV), mem_pool_host)
        assert tier.handle is not None
        tier.handle.get()  # now if it can (a store that is not up: logged, tried again later)
        log.info(
            "kvcore storage: backend %r, namespace %r, rank %d of %d, %s pages of %d tokens "
            "(%s bytes per part, %s)",
            self.settings.backend,
            namespace,
            self.identity.rank,
            self.identity.world_size,
            fmt.layout,
            fmt.page_size,
            list(fmt.part_nbytes),
            "in place" if fmt.segments == 1 else f"{fmt.segments} segments per part",
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._pools[str(host_pool_name)] = host_pool
        self._side_formats.pop(str(host_pool_name), None)

    # -- the v1 API (zero-copy through get_page_buffer_meta) ---------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Leading pages of ``keys`` stored (for this rank); 0 on any failure."""
        return self._guard("exists", 0, self._exists, keys)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages into the host pool at ``host_indices``; True for the leading run read."""
        return self._guard("get", [False] * len(keys), self._read_pages, None, keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices``; True for the leading run stored."""
        return self._guard("set", [False] * len(keys), self._write_pages, None, keys, host_indices)

    # -- the legacy API (flat pages, or raw addresses) --------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(
        self,
        key: str,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> Any:
        """Read one page into ``target_location`` (a flat page tensor, or addresses with
        ``target_sizes``); the target (True for addresses) on success, else None."""
        if target_sizes is not None:
            done = self.batch_get([key], [target_location], [target_sizes])
            return True if done == 1 else None
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None] | int:
        """Read pages into flat page tensors (a list, None from the first page not read) or,
        with ``target_sizes``, into raw addresses (the count of leading pages read)."""
        if target_sizes is not None:
            return self._guard("get", 0, self._read_pointers, keys, target_locations, target_sizes)
        return self._guard("get", [None] * len(keys), self._read_tensors, keys, target_locations)

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if value is None and target_location is not None:
            return self.batch_set([key], None, [target_location], [target_sizes])
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat page tensors (or raw addresses with ``target_sizes``); True when every
        page is stored."""
        if values is None and target_locations is not None:
            return self._guard(
                "set", False, self._write_pointers, keys, target_locations, target_sizes
            )
        return self._guard("set", False, self._write_tensors, keys, values)

    def clear(self) -> bool:
        """Remove every object of this storage's namespaces (all ranks); False when the
        backend cannot (its ``kvcore_clear`` is missing) or failed."""
        return self._guard("clear", False, self._clear)

    # -- the v2 API (hybrid pools) ----------------------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """KV hit and, per side pool, its hit under the pool's policy (SGLang's semantics:
        ``all_pages``: every page of the prefix; ``trailing_pages``: the last
        ``len(transfer.keys)`` pages of a prefix). ``block_groups`` is not served: the pool
        reports no pages and does not shorten the KV hit."""
        return self._guard(
            "exists_v2", PoolTransferResult.empty(), self._exists_v2, keys, pool_transfers or []
        )

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return {t.name: self._transfer_v2("get", t) for t in transfers}

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return {t.name: self._transfer_v2("set", t) for t in transfers}

    # -- metrics and lifecycle --------------------------------------------------------------

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per call since the last call, when
        ``enable_storage_metrics``) with ``.kvcore``: the adapter's and kvcore's counters."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            lists = {name: list(values) for name, values in self._metrics.items()}
            for values in self._metrics.values():
                values.clear()
        metrics = StorageMetrics(**lists)
        metrics.kvcore = self.kvcore_stats()
        return metrics

    def kvcore_stats(self) -> dict[str, float]:
        """Flat counters: the adapter's (``pages_*``, ``errors.<op>``, ``failures.<op>``) and
        each opened backend's kvcore counters under ``kv.`` and ``side.``."""
        out = self._counters.snapshot()
        for prefix, tier in (("kv.", self._kv), ("side.", self._side)):
            backend = tier.handle.opened if tier is not None and tier.handle else None
            if backend is not None and not self._closed:
                out.update({prefix + k: v for k, v in backend.stats().items()})
            if tier is not None and tier.handle is not None:
                out[prefix + "open_failures"] = float(tier.handle.open_failures)
        # the 0.1 name of the facade's refusal count (kv. and side. together), until 0.2
        out["pages_refused"] = out.get("kv.blocks_refused.admit", 0.0) + out.get(
            "side.blocks_refused.admit", 0.0
        )
        return out

    def close(self) -> None:
        """Unregister the host memory and close the backends; later calls are misses."""
        if self._closed:
            return
        self._closed = True
        if self._events is not None:
            self._events.close()
            self._events = None
        for tier in (self._kv, self._side):
            if tier is not None:
                self._close_tier(tier)

    # -- internals: opening -----------------------------------------------------------------

    def _open(
        self,
        namespace: str,
        layout: kvcore.CacheLayout | None,
        on_open: Callable[[kvcore.Backend], None] | None = None,
    ) -> _Tier:
        """A tier whose backend opens on first use (settings errors raise here)."""
        context = {
            "layout": layout,
            "rank": self.identity.rank,
            "world_size": self.identity.world_size,
            "namespace": namespace,
            "weight_version": self.settings.weight_version,
        }
        kvcore.check_backend_config(self.settings.backend, self.settings.backend_config)
        tier = _Tier(namespace, self.identity.rank, self.identity.world_size)
        tier.handle = kvcore.BackendHandle(
            self.settings.backend,
            self.settings.backend_config,
            context=context,
            retry_s=self.settings.reopen_interval_s,
            on_open=on_open,
        )
        return tier

    def _start_events(self, backend: kvcore.Backend, fmt: PageFormat) -> None:
        """Publish the storage tier's KV events (see :mod:`kvcore_sglang.events`)."""
        if self._events is not None:
            self._events.close()
            self._events = None
        endpoint = self.settings.events_endpoint
        if endpoint is None:
            return
        from kvcore_sglang.events import StorageEventPublisher

        medium = self.settings.events_medium or (
            "DISK" if self.settings.backend == "file" else "EXTERNAL"
        )
        self._events = StorageEventPublisher(
            backend,
            fmt.parts,
            fmt.page_size,
            endpoint,
            medium,
            topic=self.settings.events_topic,
            rank=self.identity.rank,
            world_size=self.identity.world_size,
        )

    def _register_memory(self, tier: _Tier, backend: kvcore.Backend, pool: Any) -> None:
        tier.registered.clear()  # a reopened backend: registered anew
        if not self.settings.register_host_pool:
            return
        buffers = []
        kv_buffer = getattr(pool, "kv_buffer", None)
        if isinstance(kv_buffer, torch.Tensor):
            buffers = [kv_buffer]
        elif hasattr(pool, "get_hybrid_pool_buffer"):
            buffers = [b for b in pool.get_hybrid_pool_buffer() if isinstance(b, torch.Tensor)]
        for buf in buffers:
            if buf.device.type == "cpu" and buf.numel():
                backend.register_buffer(buf.data_ptr(), buf.numel() * buf.element_size())
                tier.registered.append(buf.data_ptr())

    def _close_tier(self, tier: _Tier) -> None:
        assert tier.handle is not None
        backend = tier.handle.opened
        if backend is not None:
            for ptr in tier.registered:
                backend.unregister_buffer(ptr)
        tier.registered.clear()
        tier.handle.close()

    def _kv_tier(self) -> _Tier:
        if self._closed:
            raise RuntimeError("the kvcore storage is closed")
        if self._kv is None or self._kv_format is None:
            raise RuntimeError("register_mem_pool_host() has not been called")
        return self._kv

    def _side_tier(self) -> _Tier:
        if self._side is None:
            with self._lock:
                if self._side is None:
                    self._side = self._open(self.identity.side_namespace(), None)
        return self._side

    # -- internals: requests ----------------------------------------------------------------

    def _request(
        self,
        op: str,
        tier: _Tier,
        fmt: PageFormat,
        keys: Sequence[str],
        host: kvcore.HostBuffers | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> kvcore.BlockRequest:
        backend = tier.backend
        task = f"sglang-{op}-{next(self._tasks)}"
        if tier is self._kv and fmt.parts == MHA_PARTS and self._kv_layout is not None:
            return backend.request(task, keys, timeout_s=self.settings.timeout_s, host=host)
        # MLA's single latent part and the side pools' parts are not a CacheLayout's parts:
        # the request names them, with their sizes (checked at kvcore's door) and identity
        return backend.request(
            task,
            keys,
            timeout_s=self.settings.timeout_s,
            host=host,
            parts=fmt.parts,
            part_bytes=fmt.part_nbytes,
            rank=tier.rank if rank is None else rank,
            world_size=tier.world_size if world_size is None else world_size,
        )

    def _guard(self, op: str, miss: T, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except Exception as exc:
            self._counters.add(f"errors.{op}")
            self._failures.warning(
                (op, type(exc)),
                "kvcore storage %s failed: %s: %s; SGLang gets a miss (further %s errors of "
                "this kind are logged at debug level)",
                op,
                type(exc).__name__,
                exc,
                type(exc).__name__,
                exc_info=exc,
            )
            return miss

    def _outcome(self, op: str, outcome: kvcore.Outcome) -> int:
        failure = getattr(outcome, "failure", None)
        if failure is not None:
            self._counters.add(f"failures.{op}")
        return int(outcome)

    @staticmethod
    def _run(done: int, total: int) -> list[bool]:
        return [True] * done + [False] * (total - done)

    def _record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        if not self.storage_config.enable_storage_metrics or pages <= 0:
            return
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    # -- internals: v1 ----------------------------------------------------------------------

    def _exists(self, keys: list[str]) -> int:
        tier = self._kv_tier()
        if not keys:
            return 0
        assert self._kv_format is not None
        found = self._outcome(
            "exists", tier.backend.query(self._request("exists", tier, self._kv_format, keys))
        )
        self._counters.add("pages_queried", len(keys))
        self._counters.add("pages_found", found)
        return found

    def _read_pages(
        self,
        tier: _Tier | None,
        keys: list[str],
        host_indices: torch.Tensor,
        fmt: PageFormat | None = None,
        pool: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> list[bool]:
        tier, fmt, pool = self._pages_of(tier, fmt, pool)
        if not keys:
            return []
        t0 = time.monotonic()
        host, staging = page_buffers(
            pool, fmt, host_indices, len(keys), segmented_ok=self._segmented(tier)
        )
        request = self._request("get", tier, fmt, keys, host, rank=rank, world_size=world_size)
        done = self._outcome("get", tier.backend.read(request))
        if staging is not None:
            staging.scatter(done)
            self._counters.add("pages_staged", done)
        self._counters.add("pages_read", len(keys))
        self._counters.add("pages_read_ok", done)
        self._record("prefetch", done, done * fmt.page_nbytes, time.monotonic() - t0)
        return self._run(done, len(keys))

    def _write_pages(
        self,
        tier: _Tier | None,
        keys: list[str],
        host_indices: torch.Tensor,
        fmt: PageFormat | None = None,
        pool: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        writer: bool | None = None,
    ) -> list[bool]:
        tier, fmt, pool = self._pages_of(tier, fmt, pool)
        if not keys:
            return []
        if not (self.identity.is_writer if writer is None else writer):
            # replicated pages (MLA) are written by the storage-writer rank alone; the others
            # report what is already stored, which is the truth about those pages
            request = self._request("set", tier, fmt, keys, rank=rank, world_size=world_size)
            present = self._outcome("set", tier.backend.query(request))
            self._counters.add("pages_write_skipped", len(keys))
            return self._run(present, len(keys))
        t0 = time.monotonic()
        offered = len(keys)
        # built once: asked of the admission policy, then sliced to what it admits and written
        request = self._request("set", tier, fmt, keys, rank=rank, world_size=world_size)
        if len(host_indices) % offered == 0:  # else page_buffers below says what is wrong
            admitted = self._admitted(tier, request)
            if admitted == 0:
                return [True] * offered
            keys = keys[:admitted]
            host_indices = host_indices[: admitted * (len(host_indices) // offered)]
        host, staging = page_buffers(
            pool, fmt, host_indices, len(keys), segmented_ok=self._segmented(tier)
        )
        if staging is not None:
            staging.gather()
            self._counters.add("pages_staged", len(keys))
        done = self._outcome("set", tier.backend.write(request.slice(0, len(keys), host=host)))
        self._counters.add("pages_written", len(keys))
        self._counters.add("pages_written_ok", done)
        self._record("backup", done, done * fmt.page_nbytes, time.monotonic() - t0)
        return self._run(done, len(keys)) + [True] * (offered - len(keys))

    def _admitted(self, tier: _Tier, request: kvcore.BlockRequest) -> int:
        """How many leading pages of ``keys`` the store's admission policy takes, asked before
        anything is staged (a refused page costs no copy). A refused page is not written and is
        not a failure: it is reported as handled, so HiCache neither logs a failed backup nor
        stops the operation's later batches (as vLLM's tier reports a refused chunk's job as a
        success), and counted by kvcore's facade (``kv.blocks_refused.admit``)."""
        return int(tier.backend.admit(request))

    def _pages_of(
        self, tier: _Tier | None, fmt: PageFormat | None, pool: Any
    ) -> tuple[_Tier, PageFormat, Any]:
        """The tier, page format and pool a page call works on (the KV pool's by default)."""
        if tier is None:
            tier, fmt, pool = self._kv_tier(), self._kv_format, self.mem_pool_host
        assert fmt is not None
        return tier, fmt, pool

    @staticmethod
    def _segmented(tier: _Tier) -> bool:
        return bool(getattr(tier.backend.capabilities, "segmented_host", False))

    # -- internals: legacy ------------------------------------------------------------------

    def _read_tensors(
        self, keys: list[str], targets: Sequence[torch.Tensor] | None
    ) -> list[torch.Tensor | None]:
        tier = self._kv_tier()
        fmt = self._kv_format
        assert fmt is not None
        if not keys:
            return []
        if targets is None or len(targets) != len(keys):
            raise ValueError("batch_get needs one target page tensor per key")
        # read into the targets themselves when they are contiguous, else into stand-ins
        landing = [
            t if t.is_contiguous() and t.device.type == "cpu" else _flat_like(t) for t in targets
        ]
        host = tensor_buffers(fmt, landing)
        done = self._outcome("get", tier.backend.read(self._request("get", tier, fmt, keys, host)))
        for target, landed in zip(targets[:done], landing[:done], strict=True):
            if landed is not target:
                target.copy_(landed.view(target.dtype).view(target.shape))
        self._counters.add("pages_read", len(keys))
        self._counters.add("pages_read_ok", done)
        return [*targets[:done], *([None] * (len(keys) - done))]

    def _read_pointers(self, keys: list[str], locations: Any, sizes: Any) -> int:
        tier = self._kv_tier()
        fmt = self._kv_format
        assert fmt is not None
        if not keys:
            return 0
        host = pointer_buffers(fmt, locations, sizes)
        done = self._outcome("get", tier.backend.read(self._request("get", tier, fmt, keys, host)))
        self._counters.add("pages_read", len(keys))
        self._counters.add("pages_read_ok", done)
        return done

    def _write_tensors(self, keys: list[str], values: Sequence[torch.Tensor] | None) -> bool:
        tier = self._kv_tier()
        fmt = self._kv_format
        assert fmt is not None
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one page tensor per key")
        if not self.identity.is_writer:
            return self._exists(keys) == len(keys)
        request = self._request("set", tier, fmt, keys)
        admitted = self._admitted(tier, request)
        if admitted == 0:
            return True
        keys = keys[:admitted]
        pages = [v.contiguous().cpu() for v in values[:admitted]]  # pool views: zero-copy
        host = tensor_buffers(fmt, pages)
        done = self._outcome("set", tier.backend.write(request.slice(0, admitted, host=host)))
        self._counters.add("pages_written", len(keys))
        self._counters.add("pages_written_ok", done)
        return done == len(keys)

    def _write_pointers(self, keys: list[str], locations: Any, sizes: Any) -> bool:
        tier = self._kv_tier()
        fmt = self._kv_format
        assert fmt is not None
        if not keys:
            return True
        if not self.identity.is_writer:
            return self._exists(keys) == len(keys)
        request = self._request("set", tier, fmt, keys)
        if len(locations) == len(sizes) == len(keys):  # else pointer_buffers says what is wrong
            admitted = self._admitted(tier, request)
            if admitted == 0:
                return True
            keys = keys[:admitted]
            locations, sizes = locations[:admitted], sizes[:admitted]
        host = pointer_buffers(fmt, locations, sizes)
        done = self._outcome("set", tier.backend.write(request.slice(0, len(keys), host=host)))
        self._counters.add("pages_written", len(keys))
        self._counters.add("pages_written_ok", done)
        return done == len(keys)

    def _clear(self) -> bool:
        ok = True
        for tier in (self._kv_tier(), self._side):
            if tier is None:
                continue
            outcome = tier.backend.clear()
            if getattr(outcome, "failure", None) is not None:
                self._counters.add("failures.clear")
                self._failures.warning(
                    ("clear", outcome.failure),
                    "kvcore storage clear: %s",
                    outcome.failure,
                )
                ok = False
            self._counters.add("objects_cleared", int(outcome))
        return ok

    # -- internals: v2 ----------------------------------------------------------------------

    def _pool_route(self, name: Any) -> tuple[_Tier, PageFormat, Any, int, int, bool]:
        """(tier, page format, host pool, rank, world size, writes?) of the pool ``name``."""
        name = str(name)
        pool = self._pools.get(name)
        if pool is None:
            raise ValueError(f"pool {name!r} was not registered with register_mem_host_pool_v2")
        if name == PoolName.KV.value and pool is getattr(self, "mem_pool_host", None):
            tier = self._kv_tier()
            assert self._kv_format is not None
            return tier, self._kv_format, pool, tier.rank, tier.world_size, self.identity.is_writer
        fmt = self._side_formats.get(name)
        if fmt is None:
            probe = pool.get_page_buffer_meta(torch.arange(pool.page_size or 1))[0]
            parts = tuple(f"{name}.{j}" for j in range(len(probe)))
            fmt = describe_pool(pool, parts, str(name))
            self._side_formats[name] = fmt
        if name == PoolName.MAMBA.value:
            # Mamba state is sharded over TP ranks even when the attention KV is replicated
            rank, world, writer = self.identity.tp_rank, self.identity.tp_size, True
        else:
            rank, world = self.identity.rank, self.identity.world_size
            writer = self.identity.is_writer
        return self._side_tier(), fmt, pool, rank, world, writer

    def _transfer_v2(self, op: str, transfer: PoolTransfer) -> list[bool]:
        keys = list(transfer.keys or [])
        miss = [False] * len(keys)
        if not keys:
            return []

        def run() -> list[bool]:
            tier, fmt, pool, rank, world, writer = self._pool_route(transfer.name)
            if transfer.host_indices is None:
                raise ValueError(f"pool {transfer.name!r}: the transfer has no host_indices")
            if op == "get":
                return self._read_pages(tier, keys, transfer.host_indices, fmt, pool, rank, world)
            return self._write_pages(
                tier, keys, transfer.host_indices, fmt, pool, rank, world, writer
            )

        return self._guard(f"{op}_v2", miss, run)

    def _exists_v2(self, keys: list[str], transfers: list[PoolTransfer]) -> PoolTransferResult:
        kv_pages = self._exists(keys)
        hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in transfers:
            if not restorable:
                break
            if transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                self._failures.warning(
                    ("exists_v2", "block_groups"),
                    "kvcore storage: pool %r asks for the block_groups hit policy, which is "
                    "not served; it reports no pages",
                    transfer.name,
                )
                continue
            present = self._present_pages(transfer.name, keys[:kv_pages])
            if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                ok = {
                    end
                    for end in range(1, kv_pages + 1)
                    if all(present[max(0, end - window) : end])
                }
            else:  # all_pages
                first_missing = present.index(False) if False in present else kv_pages
                ok = set(range(1, first_missing + 1))
            if ok:
                hits[transfer.name] = max(ok)
            restorable &= ok
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def _present_pages(self, name: Any, keys: list[str]) -> list[bool]:
        """Which of ``keys`` the pool ``name`` holds, from as few leading-run queries as there
        are gaps (kvcore answers runs, not per-page flags)."""
        tier, fmt, _, rank, world, _ = self._pool_route(name)
        present = [False] * len(keys)
        i = 0
        while i < len(keys):
            request = self._request("exists", tier, fmt, keys[i:], rank=rank, world_size=world)
            outcome = tier.backend.query(request)
            run = self._outcome("exists", outcome)
            present[i : i + run] = [True] * run
            if outcome.failure is not None and i + run < len(keys):
                break  # the backend is failing: the rest counts as absent
            i += run + 1
        return present


def _flat_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8)
