"""The kvcore store behind both LMCache adapters (the MP L2 adapter and the in-process storage
plugin): opening the backend, the one runner their lookups, loads and stores go through
(:class:`kvcore.HostRunner`: its threads, the store's admission, deadlines, counters, per-key
answers), and answering any other failure as a miss.

Importing this module imports neither LMCache nor torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import kvcore
from kvcore.estimates import PrefillRate
from kvcore.load_costs import LoadDecider
from kvcore.registry import load_backend_class
from kvcore_lmcache.settings import AdapterSettings

__all__ = ["Store"]

log = logging.getLogger("kvcore_lmcache")

T = TypeVar("T")


class Store:
    """One kvcore backend by name, opened as LMCache needs it: settings errors raise at once
    (LMCache's start fails naming them); a backend that cannot open is a miss on every call
    until it opens (``reopen_interval_s``); any failure below is logged once per kind and
    counted, and answered with a default (:meth:`guard`)."""

    def __init__(
        self, settings: AdapterSettings, on_open: Callable[[kvcore.Backend], object] | None = None
    ) -> None:
        self.settings = settings
        load_backend_class(settings.backend)  # an unknown backend fails the start, by name
        kvcore.check_backend_config(
            settings.backend, settings.backend_config, where=f"{settings.where}: backend_config"
        )
        self.counters = kvcore.Counters()
        self._failures = kvcore.OnceLogger(log)
        self.closed = False
        self.handle = kvcore.BackendHandle(
            settings.backend,
            settings.backend_config,
            context={"namespace": settings.namespace, "layout": None},
            requires={"io": "host", "addressing": "key"},
            retry_s=settings.reopen_interval_s,
            on_open=on_open,
        )
        #: load or recompute (kvcore.load_costs): LMCache's storage layer sees no engine step,
        #: so the prefill rate is the settings' ``prefill_tokens_per_s`` (unset: load all)
        self.decider = LoadDecider(
            PrefillRate(tokens_per_s=settings.prefill_tokens_per_s),
            policy=settings.load_policy,
            margin=settings.load_margin,
        )
        #: every lookup, load, store and removal of LMCache's objects, synchronous or as a
        #: task on its threads (``io_threads`` for lookups and loads, as many for stores)
        self.runner = kvcore.HostRunner(
            self.handle,
            name="lmcache",
            read_workers=settings.io_threads,
            write_workers=settings.io_threads,
            timeout_s=settings.timeout_s,
        )

    def backend(self) -> kvcore.Backend | None:
        """The backend, opening it if due; None while it cannot be opened or once closed."""
        return None if self.closed else self.handle.get()

    @property
    def opened(self) -> kvcore.Backend | None:
        """The backend if it is open now (never opens it)."""
        return None if self.closed else self.handle.opened

    def checks_layout(self, backend: kvcore.Backend) -> bool:
        """Whether objects are stored with their layout and checked against it."""
        return self.settings.verify_layout and backend.capabilities.block_meta

    def layout_unknowable(self, backend: kvcore.Backend) -> str | None:
        """Why ``backend`` cannot serve loads under these settings (None: it can): layouts are
        to be checked (``verify_layout``) and the backend keeps no block metadata to check
        them against. Loads are then refused, never guessed."""
        if self.settings.verify_layout and not backend.capabilities.block_meta:
            return (
                f"backend {self.settings.backend!r} keeps no block metadata, so a stored "
                "object's layout (dtype, shape) cannot be checked at load; set verify_layout: "
                "false where every server of this namespace runs one KV dtype per model name, "
                "or stack it under a tier that keeps metadata (docs/lmcache.md)"
            )
        return None

    def worth_loading(
        self,
        found: int,
        chunk_bytes: int | None,
        chunk_tokens: int | None,
        probe: Callable[[kvcore.Backend], kvcore.BlockRequest] | None = None,
    ) -> int:
        """How many of ``found`` stored leading chunks LMCache should load: kvcore's
        load-or-recompute decision over the store's measured read rate, measured first by a
        few reads of ``probe``'s chunks where it is unknown (``chunks_declined`` counts the
        rest). Chunks of unknown size or tokens: all of them, as before."""
        if found <= 0 or not chunk_bytes or not chunk_tokens:
            return max(0, found)
        choice = self.runner.plan_load(
            self.decider, found, block_bytes=chunk_bytes, block_tokens=chunk_tokens, probe=probe
        )
        if choice.declined:
            self.counters.add("chunks_declined", choice.declined)
        return choice.blocks

    def guard(self, op: str, default: T, fn: Callable[[], T]) -> T:
        """``fn()``, or ``default`` when it raises (logged once per kind, counted)."""
        try:
            return fn()
        except Exception as exc:
            self.counters.add(f"{op}_errors")
            self._failures.warning(
                (op, type(exc).__name__),
                "kvcore LMCache adapter: %s failed (%s: %s); answered as a miss",
                op,
                type(exc).__name__,
                exc,
            )
            log.debug("%s failed", op, exc_info=True)
            return default

    def status(self) -> dict[str, Any]:
        """The runner's counters (``<name>.<op>``, kvcore's one vocabulary: ``blocks_done.read``,
        ``blocks_refused.write``, ...), the adapter's own, the backend's (``kvcore_*``), and
        whether it is open."""
        backend = self.opened
        out: dict[str, Any] = {
            "is_healthy": backend is not None,
            "backend": self.settings.backend,
            "namespace": self.settings.namespace,
            "open_failures": self.handle.open_failures,
            **self.runner.stats(),
            **self.counters.snapshot(),
            **{f"decide.{k}": v for k, v in self.decider.stats().items()},
        }
        if backend is not None:
            out.update({f"kvcore_{k}": v for k, v in backend.stats().items()})
        return out

    def close(self) -> None:
        """End the runner's tasks (queued ones answered as misses; running ones end by their
        deadline) and close the backend."""
        self.closed = True
        self.runner.close()
        self.handle.close()
