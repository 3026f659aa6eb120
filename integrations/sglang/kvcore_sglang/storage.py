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

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

import kvcore
from kvcore.registry import load_backend_class
from kvcore_sglang import legacy, page_facts
from kvcore_sglang.pages import PageFormat, describe_pool, kv_cache_layout
from kvcore_sglang.settings import StorageIdentity, StorageSettings
from kvcore_sglang.side_pools import Route, SidePools, pool_hits, present_pages
from kvcore_sglang.stats import TransferMetrics, kvcore_counters
from kvcore_sglang.tiers import StoreUnavailable as StoreUnavailable
from kvcore_sglang.tiers import (
    Tier,
    close_tier,
    events_publisher,
    open_tier,
    register_memory,
)
from kvcore_sglang.transfers import MHA_PARTS, MLA_PARTS, PageTransfers

__all__ = ["KVCoreHiCacheStorage"]

log = logging.getLogger("kvcore_sglang")

T = TypeVar("T")

#: Host layouts whose pages are K/V (or latent) parts, one region each or one per layer.
KV_LAYOUTS = ("page_first", "page_first_direct", "page_head", "layer_first")


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
        # the v2 API's pools by name, and the side tier that stores all but the KV pool
        self._side_pools = SidePools(self.settings, self.identity)
        self._kv: Tier | None = None
        self._kv_format: PageFormat | None = None  # the KV tier's layout is tier.layout
        self._counters = kvcore.Counters()
        self._failures = kvcore.OnceLogger(log)
        self._metrics = TransferMetrics(storage_config)
        self._io = PageTransfers(self.settings, self._counters, self._metrics)
        self._events: Any = None  # a StorageEventPublisher, with events_endpoint set
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
            close_tier(self._kv)

        def attach(backend: kvcore.Backend) -> None:  # each time the backend opens
            register_memory(tier, backend, mem_pool_host, enabled=self.settings.register_host_pool)
            self._start_events(backend, fmt)

        namespace = self.identity.kv_namespace(fmt.tag)
        self._kv = tier = open_tier(self.settings, self.identity, namespace, layout, attach)
        self._kv_format = fmt
        self._side_pools.pools.setdefault(str(PoolName.KV), mem_pool_host)
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
        self._side_pools.register(host_pool_name, host_pool)

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
        return self._guard("get", [False] * len(keys), self._read_kv_pages, keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices``; True for the leading run stored.
        Each page carries its token ids and parent when SGLang's backup operation shows them
        (see :mod:`kvcore_sglang.page_facts`)."""
        facts = self._page_facts(keys)
        return self._guard(
            "set", [False] * len(keys), self._write_kv_pages, keys, host_indices, facts
        )

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

        metrics = StorageMetrics(**self._metrics.take())
        metrics.kvcore = self.kvcore_stats()
        return metrics

    def kvcore_stats(self) -> dict[str, float]:
        """Flat counters: the adapter's (``pages_*``, ``errors.<op>``, ``failures.<op>``) and
        each opened backend's kvcore counters under ``kv.`` and ``side.``."""
        tiers = (("kv.", self._kv), ("side.", self._side_pools.tier))
        out = kvcore_counters(self._counters, tiers, self._closed)
        # the load-or-recompute decision's counters and prefill estimate (the store's read
        # rate is the backend's: kv.read_bytes_per_s)
        out.update({f"decide.{k}": v for k, v in self._io.decider.stats().items()})
        return out

    def close(self) -> None:
        """Unregister the host memory and close the backends; later calls are misses."""
        if self._closed:
            return
        self._closed = True
        if self._events is not None:
            self._events.close()
            self._events = None
        for tier in (self._kv, self._side_pools.tier):
            if tier is not None:
                close_tier(tier)

    # -- internals: opening -----------------------------------------------------------------

    def _start_events(self, backend: kvcore.Backend, fmt: PageFormat) -> None:
        """Publish the storage tier's KV events (see :mod:`kvcore_sglang.events`)."""
        if self._events is not None:
            self._events.close()
            self._events = None
        self._events = events_publisher(self.settings, self.identity, backend, fmt)

    def _kv_tier(self) -> Tier:
        if self._closed:
            raise RuntimeError("the kvcore storage is closed")
        if self._kv is None or self._kv_format is None:
            raise RuntimeError("register_mem_pool_host() has not been called")
        return self._kv

    def _kv_route(self) -> tuple[Tier, PageFormat]:
        """The KV tier and its page format. :raises RuntimeError: closed, or no KV pool."""
        tier = self._kv_tier()
        assert self._kv_format is not None
        return tier, self._kv_format

    # -- internals: requests ----------------------------------------------------------------

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

    # -- internals: v1 and legacy (the KV pool, see kvcore_sglang.transfers and .legacy) -----

    def _exists(self, keys: list[str]) -> int:
        tier, fmt = self._kv_route()
        found = self._io.exists(tier, fmt, keys).leading
        return self._io.worth_loading(tier, fmt, found, keys)  # found, unless reading is slower

    def _read_kv_pages(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        tier, fmt = self._kv_route()
        return self._io.read_pages(tier, fmt, self.mem_pool_host, keys, host_indices)

    def _write_kv_pages(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        facts: list[bytes] | None = None,
    ) -> list[bool]:
        tier, fmt = self._kv_route()
        writer = self.identity.is_writer
        return self._io.write_pages(
            tier, fmt, self.mem_pool_host, keys, host_indices, writer, block_meta=facts
        )

    def _page_facts(self, keys: list[str]) -> list[bytes] | None:
        """The pages' facts as block metadata, for a KV tier that keeps it (b"" for a page
        whose tokens could not be checked); None when there is nothing to keep."""
        tier, fmt = self._kv, self._kv_format
        if tier is None or fmt is None or not keys:
            return None
        try:
            if not tier.backend.capabilities.block_meta:
                return None
        except StoreUnavailable:
            return None
        found = page_facts.backup_facts(keys, fmt.page_size)
        if not any(found):
            self._counters.add("pages_without_tokens", len(keys))
            return None
        self._counters.add("pages_without_tokens", found.count(None))
        return [b"" if f is None else page_facts.encode(f) for f in found]

    def _read_tensors(
        self, keys: list[str], targets: Sequence[torch.Tensor] | None
    ) -> list[torch.Tensor | None]:
        return legacy.read_tensors(self._io, *self._kv_route(), keys, targets)

    def _read_pointers(self, keys: list[str], locations: Any, sizes: Any) -> int:
        return legacy.read_pointers(self._io, *self._kv_route(), keys, locations, sizes)

    def _write_tensors(self, keys: list[str], values: Sequence[torch.Tensor] | None) -> bool:
        tier, fmt = self._kv_route()
        return legacy.write_tensors(self._io, tier, fmt, keys, values, self.identity.is_writer)

    def _write_pointers(self, keys: list[str], locations: Any, sizes: Any) -> bool:
        tier, fmt = self._kv_route()
        writer = self.identity.is_writer
        return legacy.write_pointers(self._io, tier, fmt, keys, locations, sizes, writer)

    def _clear(self) -> bool:
        ok = True
        for tier in (self._kv_tier(), self._side_pools.tier):
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

    # -- internals: v2 (see kvcore_sglang.side_pools) ----------------------------------------

    def _pool_route(self, name: Any) -> Route:
        """(tier, page format, host pool, rank, world size, writes?) of the pool ``name``."""
        name = str(name)
        pool = self._side_pools.pool(name)
        if name == PoolName.KV.value and pool is getattr(self, "mem_pool_host", None):
            tier = self._kv_tier()
            assert self._kv_format is not None
            return Route(
                tier, self._kv_format, pool, tier.rank, tier.world_size, self.identity.is_writer
            )
        return self._side_pools.route(name, pool)

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
                return self._io.read_pages(
                    tier, fmt, pool, keys, transfer.host_indices, rank, world
                )
            return self._io.write_pages(
                tier, fmt, pool, keys, transfer.host_indices, writer, rank, world
            )

        return self._guard(f"{op}_v2", miss, run)

    def _exists_v2(self, keys: list[str], transfers: list[PoolTransfer]) -> PoolTransferResult:
        return pool_hits(keys, self._exists(keys), transfers, self._present_pages, self._failures)

    def _present_pages(self, name: Any, keys: list[str]) -> list[bool]:
        return present_pages(self._io, self._pool_route(name), keys)
