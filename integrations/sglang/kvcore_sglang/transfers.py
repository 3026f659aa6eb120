"""Pages in and out of a tier: kvcore requests, run through the tier's runner.

:class:`PageTransfers` works on whatever tier, page format and host pool it is given: the KV
pool's for the v1 API, a side pool's for the v2 API (see :mod:`kvcore_sglang.side_pools`), the
legacy API's flat pages and addresses through :mod:`kvcore_sglang.legacy`. Every lookup, read
and write runs through the tier's :class:`kvcore.HostRunner` (on SGLang's calling thread):
the store's admission, a store that is not open, the counters (``<tier>.host.*``) are kvcore's.
It counts what is SGLang's alone (``pages_staged``, ``pages_write_skipped``) and records
SGLang's storage metrics.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import kvcore
from kvcore.estimates import PrefillRate
from kvcore.load_costs import LoadDecider
from kvcore_sglang.pages import PageFormat, page_buffers
from kvcore_sglang.settings import StorageSettings
from kvcore_sglang.stats import TransferMetrics
from kvcore_sglang.tiers import Tier

__all__ = ["MHA_PARTS", "MLA_PARTS", "PageTransfers", "leading"]

#: Part names of a KV page: MHA stores K and V, MLA one latent row per token.
MHA_PARTS = ("k", "v")
MLA_PARTS = ("kv",)


def leading(done: int, total: int) -> list[bool]:
    """SGLang's per-page answer for a leading run of ``done`` pages out of ``total``."""
    return [True] * done + [False] * (total - done)


class PageTransfers:
    """Requests on tiers, with the storage's settings (``timeout_s``), ``counters`` and
    ``metrics``. Every method raises on what the caller got wrong (the storage's guard turns it
    into a miss); the store's own failures are answers."""

    def __init__(
        self, settings: StorageSettings, counters: kvcore.Counters, metrics: TransferMetrics
    ) -> None:
        self.settings = settings
        #: the tenant of every request (SGLang's storage calls carry no request, so no salt:
        #: the settings' default tenant, one per engine; None without tenants)
        self.tenant = settings.tenant_of()
        self.counters = counters
        self.metrics = metrics
        self._tasks = itertools.count()
        #: load or recompute (kvcore.load_costs): SGLang's storage layer sees no engine step,
        #: so the prefill rate is the settings' ``prefill_tokens_per_s`` (unset: load all)
        self.decider = LoadDecider(
            PrefillRate(tokens_per_s=settings.prefill_tokens_per_s),
            policy=settings.load_policy,
            margin=settings.load_margin,
        )

    def request(
        self,
        op: str,
        tier: Tier,
        fmt: PageFormat,
        keys: Sequence[str],
        host: kvcore.HostBuffers | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        block_meta: Sequence[bytes] | None = None,
    ) -> Callable[[kvcore.Backend], kvcore.BlockRequest]:
        """The request of ``keys`` on ``tier``, built by the runner from the opened backend."""
        task = f"sglang-{op}-{next(self._tasks)}"

        def build(backend: kvcore.Backend) -> kvcore.BlockRequest:
            if tier.layout is not None and fmt.parts == MHA_PARTS:
                return backend.request(
                    task,
                    keys,
                    timeout_s=self.settings.timeout_s,
                    host=host,
                    block_meta=block_meta,
                    tenant=self.tenant,
                )
            # MLA's single latent part and the side pools' parts are not a CacheLayout's
            # parts: the request names them, with their sizes (checked at kvcore's door) and
            # identity
            return backend.request(
                task,
                keys,
                timeout_s=self.settings.timeout_s,
                host=host,
                parts=fmt.parts,
                part_bytes=fmt.part_nbytes,
                rank=tier.rank if rank is None else rank,
                world_size=tier.world_size if world_size is None else world_size,
                block_meta=block_meta,
                tenant=self.tenant,
            )

        return build

    def exists(
        self,
        tier: Tier,
        fmt: PageFormat,
        keys: list[str],
        rank: int | None = None,
        world_size: int | None = None,
        *,
        each: bool = False,
    ) -> kvcore.HostResult:
        """Which pages of ``keys`` are stored: the leading run, or each page (``each``)."""
        request = self.request("exists", tier, fmt, keys, rank=rank, world_size=world_size)
        return tier.runner.lookup(request, blocks=len(keys), each=each)

    def worth_loading(
        self, tier: Tier, fmt: PageFormat, found: int, keys: Sequence[str] = ()
    ) -> int:
        """How many of ``found`` stored leading pages (of ``keys``) to prefetch: kvcore's
        load-or-recompute decision over the tier's measured read rate, measured first by a
        few reads of those pages where it is unknown (the pages declined are SGLang's to
        compute: ``pages_declined``)."""
        if found <= 0:
            return 0
        choice = tier.runner.plan_load(
            self.decider,
            found,
            block_bytes=fmt.page_nbytes,
            block_tokens=fmt.page_size,
            probe=self.request("probe", tier, fmt, keys[:found]) if keys else None,
        )
        if choice.declined:
            self.counters.add("pages_declined", choice.declined)
        return choice.blocks

    def read_pages(
        self,
        tier: Tier,
        fmt: PageFormat,
        pool: Any,
        keys: list[str],
        host_indices: torch.Tensor,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> list[bool]:
        """Read pages into ``pool`` at ``host_indices`` (in place, else staged)."""
        if not keys:
            return []
        t0 = time.monotonic()
        host, staging = page_buffers(
            pool, fmt, host_indices, len(keys), segmented_ok=_segmented(tier)
        )
        request = self.request("get", tier, fmt, keys, host, rank=rank, world_size=world_size)
        done = tier.runner.read(request, blocks=len(keys)).leading
        if staging is not None:
            staging.scatter(done)
            self.counters.add("pages_staged", done)
        self.metrics.record("prefetch", done, done * fmt.page_nbytes, time.monotonic() - t0)
        return leading(done, len(keys))

    def write_pages(
        self,
        tier: Tier,
        fmt: PageFormat,
        pool: Any,
        keys: list[str],
        host_indices: torch.Tensor,
        writer: bool,
        rank: int | None = None,
        world_size: int | None = None,
        block_meta: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Store ``pool``'s pages at ``host_indices`` (what the store admits of them) when
        this rank is the ``writer``; else report what is already stored. A page the store's
        admission refuses is not written and is not a failure: it is reported as handled, so
        HiCache neither logs a failed backup nor stops the operation's later batches.
        ``block_meta``: what each page says of itself (see :mod:`kvcore_sglang.page_facts`)."""
        if not keys:
            return []
        if not writer:
            # replicated pages (MLA) are written by the storage-writer rank alone; the others
            # report what is already stored, which is the truth about those pages
            present = self.exists(tier, fmt, keys, rank, world_size).leading
            self.counters.add("pages_write_skipped", len(keys))
            return leading(present, len(keys))
        t0 = time.monotonic()
        offered = len(keys)
        per_page, extra = divmod(len(host_indices), offered)
        if extra or not per_page:
            raise ValueError(f"{len(host_indices)} host indices do not split into {offered} pages")

        def fill(request: kvcore.BlockRequest, admitted: int) -> kvcore.HostBuffers:
            # only the pages admitted are described and staged: a refused page costs no copy
            host, staging = page_buffers(
                pool, fmt, host_indices[: admitted * per_page], admitted,
                segmented_ok=_segmented(tier),
            )  # fmt: skip
            if staging is not None:
                staging.gather()
                self.counters.add("pages_staged", admitted)
            return host

        request = self.request(
            "set", tier, fmt, keys, rank=rank, world_size=world_size, block_meta=block_meta
        )
        result = tier.runner.write(request, blocks=offered, fill=fill)
        done = result.count
        self.metrics.record("backup", done, done * fmt.page_nbytes, time.monotonic() - t0)
        return list(result.handled)


def _segmented(tier: Tier) -> bool:
    """Whether the tier's backend takes per-layer segments (else pages are staged)."""
    backend = tier.handle.get() if tier.handle is not None else None
    return bool(backend is not None and backend.capabilities.segmented_host)
