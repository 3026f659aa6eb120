"""The storage's kvcore backends: opening, host-pool registration, events and closing.

A tier is one kvcore backend, held by a :class:`kvcore.BackendHandle` (opened when it can be,
reopened on kvcore's schedule, ``reopen_interval_s``), with the identity its objects are named
with. The KV tier stores the host KV pool's pages; the side tier, opened at first use, every
other pool's (see :mod:`kvcore_sglang.side_pools`). Each time a backend opens, the handle's
``on_open`` registers the host pool's memory with it and starts the KV events publisher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import kvcore
from kvcore_sglang.pages import PageFormat
from kvcore_sglang.settings import StorageIdentity, StorageSettings

__all__ = ["StoreUnavailable", "Tier", "close_tier", "events_publisher", "open_tier"]


class StoreUnavailable(RuntimeError):
    """The backend is not open (it failed to open and is tried again on schedule)."""


class Tier:
    """One kvcore backend (by handle: opened when it can be, reopened on kvcore's schedule)
    and the identity its objects are named with.

    :param layout: the cache layout the backend was opened with (None: the requests name
        their parts, see :meth:`kvcore_sglang.transfers.PageTransfers.request`).
    """

    def __init__(
        self,
        namespace: str,
        rank: int,
        world_size: int,
        layout: kvcore.CacheLayout | None = None,
    ) -> None:
        self.namespace = namespace
        self.rank = rank
        self.world_size = world_size
        self.layout = layout
        self.handle: kvcore.BackendHandle | None = None
        #: every lookup, read and write of the tier's pages (kvcore's one host path)
        self.runner: kvcore.HostRunner | None = None
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

    def stats(self, prefix: str, closed: bool) -> dict[str, float]:
        """The runner's counters (``<prefix>host.*``, kvcore's vocabulary of every adapter),
        the opened backend's per call (none once ``closed``) and the handle's failed opens,
        each under ``prefix``."""
        out: dict[str, float] = {}
        if self.runner is not None:
            out.update(self.runner.stats(prefix + "host."))
        backend = self.handle.opened if self.handle else None
        if backend is not None and not closed:
            out.update({prefix + k: v for k, v in backend.stats().items()})
        if self.handle is not None:
            out[prefix + "open_failures"] = float(self.handle.open_failures)
        return out


def open_tier(
    settings: StorageSettings,
    identity: StorageIdentity,
    namespace: str,
    layout: kvcore.CacheLayout | None,
    on_open: Callable[[kvcore.Backend], None] | None = None,
) -> Tier:
    """A tier whose backend opens on first use (settings errors raise here)."""
    context = {
        "layout": layout,
        "rank": identity.rank,
        "world_size": identity.world_size,
        "namespace": namespace,
        "weight_version": settings.weight_version,
    }
    kvcore.check_backend_config(settings.backend, settings.backend_config)
    tier = Tier(namespace, identity.rank, identity.world_size, layout)
    tier.handle = kvcore.BackendHandle(
        settings.backend,
        settings.backend_config,
        context=context,
        retry_s=settings.reopen_interval_s,
        on_open=on_open,
    )
    tier.runner = kvcore.HostRunner(tier.handle, name="sglang")
    return tier


def register_memory(tier: Tier, backend: kvcore.Backend, pool: Any, *, enabled: bool) -> None:
    """Register the host pool's CPU buffers with a (re)opened backend, when ``enabled``
    (``register_host_pool``); remembered on the tier for :func:`close_tier`."""
    tier.registered.clear()  # a reopened backend: registered anew
    if not enabled:
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


def close_tier(tier: Tier) -> None:
    """Unregister the host memory from the tier's backend (if open) and close its handle."""
    assert tier.handle is not None
    if tier.runner is not None:
        tier.runner.close()
    backend = tier.handle.opened
    if backend is not None:
        for ptr in tier.registered:
            backend.unregister_buffer(ptr)
    tier.registered.clear()
    tier.handle.close()


def events_publisher(
    settings: StorageSettings, identity: StorageIdentity, backend: kvcore.Backend, fmt: PageFormat
) -> Any:
    """A publisher of the storage tier's KV events on ``backend`` (see
    :mod:`kvcore_sglang.events`), or None when no ``events_endpoint`` is set."""
    endpoint = settings.events_endpoint
    if endpoint is None:
        return None
    from kvcore_sglang.events import StorageEventPublisher

    medium = settings.events_medium or ("DISK" if settings.backend == "file" else "EXTERNAL")
    return StorageEventPublisher(
        backend,
        fmt.parts,
        fmt.page_size,
        endpoint,
        medium,
        topic=settings.events_topic,
        rank=identity.rank,
        world_size=identity.world_size,
    )
