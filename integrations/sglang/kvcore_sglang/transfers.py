"""Pages in and out of a tier: kvcore requests, their outcomes, and the v1 zero-copy I/O.

:class:`PageTransfers` works on whatever tier, page format and host pool it is given: the KV
pool's for the v1 API, a side pool's for the v2 API (see :mod:`kvcore_sglang.side_pools`), the
legacy API's flat pages and addresses through :mod:`kvcore_sglang.legacy`. It counts what it
moves (``pages_*``, ``failures.<op>``) and records SGLang's storage metrics.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch

import kvcore
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
    ``metrics``. Every method raises on a failure that is not the backend's answer (the
    storage's guard turns it into a miss)."""

    def __init__(
        self, settings: StorageSettings, counters: kvcore.Counters, metrics: TransferMetrics
    ) -> None:
        self.settings = settings
        self.counters = counters
        self.metrics = metrics
        self._tasks = itertools.count()

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
    ) -> kvcore.BlockRequest:
        backend = tier.backend
        task = f"sglang-{op}-{next(self._tasks)}"
        if tier.layout is not None and fmt.parts == MHA_PARTS:
            return backend.request(
                task, keys, timeout_s=self.settings.timeout_s, host=host, block_meta=block_meta
            )
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
            block_meta=block_meta,
        )

    def outcome(self, op: str, outcome: kvcore.Outcome) -> int:
        """The blocks an outcome counts (a failure counted as ``failures.<op>``)."""
        failure = getattr(outcome, "failure", None)
        if failure is not None:
            self.counters.add(f"failures.{op}")
        return int(outcome)

    @staticmethod
    def admitted(tier: Tier, request: kvcore.BlockRequest) -> int:
        """How many leading pages of ``keys`` the store's admission policy takes, asked before
        anything is staged (a refused page costs no copy). A refused page is not written and is
        not a failure: it is reported as handled, so HiCache neither logs a failed backup nor
        stops the operation's later batches (as vLLM's tier reports a refused chunk's job as a
        success), and counted by kvcore's facade (``kv.blocks_refused.admit``)."""
        return int(tier.backend.admit(request))

    def exists(self, tier: Tier, fmt: PageFormat, keys: list[str]) -> int:
        """Leading pages of ``keys`` stored (counted as ``pages_queried``/``pages_found``)."""
        if not keys:
            return 0
        found = self.outcome("exists", tier.backend.query(self.request("exists", tier, fmt, keys)))
        self.counters.add("pages_queried", len(keys))
        self.counters.add("pages_found", found)
        return found

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
        done = self.outcome("get", tier.backend.read(request))
        if staging is not None:
            staging.scatter(done)
            self.counters.add("pages_staged", done)
        self.counters.add("pages_read", len(keys))
        self.counters.add("pages_read_ok", done)
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
        """Store ``pool``'s pages at ``host_indices`` (the admitted leading run of them) when
        this rank is the ``writer``; else report what is already stored. ``block_meta``: what
        each page says of itself (see :mod:`kvcore_sglang.page_facts`)."""
        if not keys:
            return []
        if not writer:
            # replicated pages (MLA) are written by the storage-writer rank alone; the others
            # report what is already stored, which is the truth about those pages
            request = self.request("set", tier, fmt, keys, rank=rank, world_size=world_size)
            present = self.outcome("set", tier.backend.query(request))
            self.counters.add("pages_write_skipped", len(keys))
            return leading(present, len(keys))
        t0 = time.monotonic()
        offered = len(keys)
        # built once: asked of the admission policy, then sliced to what it admits and written
        request = self.request(
            "set", tier, fmt, keys, rank=rank, world_size=world_size, block_meta=block_meta
        )
        if len(host_indices) % offered == 0:  # else page_buffers below says what is wrong
            admitted = self.admitted(tier, request)
            if admitted == 0:
                return [True] * offered
            keys = keys[:admitted]
            host_indices = host_indices[: admitted * (len(host_indices) // offered)]
        host, staging = page_buffers(
            pool, fmt, host_indices, len(keys), segmented_ok=_segmented(tier)
        )
        if staging is not None:
            staging.gather()
            self.counters.add("pages_staged", len(keys))
        done = self.outcome("set", tier.backend.write(request.slice(0, len(keys), host=host)))
        self.counters.add("pages_written", len(keys))
        self.counters.add("pages_written_ok", done)
        self.metrics.record("backup", done, done * fmt.page_nbytes, time.monotonic() - t0)
        return leading(done, len(keys)) + [True] * (offered - len(keys))


def _segmented(tier: Tier) -> bool:
    return bool(getattr(tier.backend.capabilities, "segmented_host", False))
