"""The v2 API's pools (hybrid models): where each pool's pages go, and the pools' hits.

SGLang registers every host pool by name (``register_mem_host_pool_v2``). The KV pool's pages
go to the KV tier; every other pool's (a "side pool": Mamba state, ...) to the one side tier,
opened at first use under the identity's side namespace, each pool with its own parts
``<pool>.<j>`` described from its first page at first use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from sglang.srt.mem_cache.hicache_storage import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

import kvcore
from kvcore_sglang.pages import PageFormat, describe_pool
from kvcore_sglang.settings import StorageIdentity, StorageSettings
from kvcore_sglang.tiers import Tier, open_tier
from kvcore_sglang.transfers import PageTransfers

__all__ = ["Route", "SidePools", "pool_hits", "present_pages"]


class Route(NamedTuple):
    """Where a pool's pages go: the tier, their page format and host pool, the rank identity
    they are named with, and whether this rank writes them."""

    tier: Tier
    fmt: PageFormat
    pool: Any
    rank: int
    world_size: int
    writer: bool


class SidePools:
    """The pools registered by name (the KV pool among them) and the side tier."""

    def __init__(self, settings: StorageSettings, identity: StorageIdentity) -> None:
        self._settings = settings
        self._identity = identity
        # SGLang's PoolName is a str Enum whose hash is its member name's: look pools up by value
        self.pools: dict[str, Any] = {}
        self.formats: dict[str, PageFormat] = {}
        self.tier: Tier | None = None  # the side tier, once opened
        self._lock = threading.Lock()

    def register(self, name: Any, pool: Any) -> None:
        """Pool ``name`` is ``pool`` from now on (its format is described anew)."""
        self.pools[str(name)] = pool
        self.formats.pop(str(name), None)

    def pool(self, name: str) -> Any:
        """The pool registered as ``name``. :raises ValueError: none is."""
        pool = self.pools.get(name)
        if pool is None:
            raise ValueError(f"pool {name!r} was not registered with register_mem_host_pool_v2")
        return pool

    def side_tier(self) -> Tier:
        """The side tier, opened (by handle) at the first call."""
        if self.tier is None:
            with self._lock:
                if self.tier is None:
                    self.tier = open_tier(
                        self._settings, self._identity, self._identity.side_namespace(), None
                    )
        return self.tier

    def route(self, name: str, pool: Any) -> Route:
        """The route of side pool ``name`` (``pool``), its format described at first use."""
        fmt = self.formats.get(name)
        if fmt is None:
            probe = pool.get_page_buffer_meta(torch.arange(pool.page_size or 1))[0]
            parts = tuple(f"{name}.{j}" for j in range(len(probe)))
            fmt = describe_pool(pool, parts, str(name))
            self.formats[name] = fmt
        identity = self._identity
        if name == PoolName.MAMBA.value:
            # Mamba state is sharded over TP ranks even when the attention KV is replicated
            rank, world, writer = identity.tp_rank, identity.tp_size, True
        else:
            rank, world = identity.rank, identity.world_size
            writer = identity.is_writer
        return Route(self.side_tier(), fmt, pool, rank, world, writer)


def present_pages(io: PageTransfers, route: Route, keys: list[str]) -> list[bool]:
    """Which of ``keys`` the pool of ``route`` holds, each page on its own (one ``contains``
    call, gaps included; a failing backend's pages count as absent)."""
    tier, fmt, _, rank, world, _ = route
    return list(io.exists(tier, fmt, keys, rank, world, each=True).done)


def pool_hits(
    keys: list[str],
    kv_pages: int,
    transfers: list[PoolTransfer],
    holds: Callable[[Any, list[str]], list[bool]],
    failures: kvcore.OnceLogger,
) -> PoolTransferResult:
    """The v2 hit of ``keys``: ``kv_pages`` leading KV pages, shortened to what every pool of
    ``transfers`` can restore under its hit policy (``holds(pool name, keys)``: which of the
    KV hit's pages the pool holds). ``block_groups`` is not served: the pool reports no pages
    and does not shorten the KV hit."""
    hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
    restorable = set(range(1, kv_pages + 1))
    for transfer in transfers:
        if not restorable:
            break
        if transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
            failures.warning(
                ("exists_v2", "block_groups"),
                "kvcore storage: pool %r asks for the block_groups hit policy, which is "
                "not served; it reports no pages",
                transfer.name,
            )
            continue
        present = holds(transfer.name, keys[:kv_pages])
        if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            window = max(1, len(transfer.keys or ()))
            ok = {end for end in range(1, kv_pages + 1) if all(present[max(0, end - window) : end])}
        else:  # all_pages
            first_missing = present.index(False) if False in present else kv_pages
            ok = set(range(1, first_missing + 1))
        if ok:
            hits[transfer.name] = max(ok)
        restorable &= ok
    ordered = sorted(restorable)
    return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)
