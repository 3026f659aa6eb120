"""The storage's stats: SGLang's per-call storage metrics and the flat kvcore counters.

:class:`TransferMetrics` keeps what SGLang's ``StorageMetrics`` reports (pages and GB/s of
each prefetch and backup, when ``enable_storage_metrics``) until the next ``get_stats`` takes
it; :func:`kvcore_counters` is the adapter's counters with each opened backend's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import kvcore
from kvcore_sglang.tiers import Tier

__all__ = ["TransferMetrics", "kvcore_counters"]


class TransferMetrics:
    """Pages and bandwidth of each prefetch and backup since the last :meth:`take`, recorded
    while the storage config's ``enable_storage_metrics`` is set. Thread-safe."""

    def __init__(self, storage_config: Any) -> None:
        self._config = storage_config
        self._lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }

    def record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        """One call of ``kind`` (``prefetch`` or ``backup``) moved ``pages`` pages."""
        if not self._config.enable_storage_metrics or pages <= 0:
            return
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    def take(self) -> dict[str, list[float]]:
        """What was recorded since the last call (the keys of SGLang's ``StorageMetrics``)."""
        with self._lock:
            lists = {name: list(values) for name, values in self._metrics.items()}
            for values in self._metrics.values():
                values.clear()
        return lists


#: the 0.1 names of the runner's counters (kv. and side. together), kept until 0.2
_DEPRECATED = {
    "pages_queried": ("blocks.lookup",),
    "pages_found": ("blocks_done.lookup",),
    "pages_read": ("blocks.read",),
    "pages_read_ok": ("blocks_done.read",),
    "pages_written": ("blocks.write", "-blocks_refused.write"),  # those admitted
    "pages_written_ok": ("blocks_done.write",),
    "pages_refused": ("blocks_refused.write",),
}


def kvcore_counters(
    counters: kvcore.Counters, tiers: Iterable[tuple[str, Tier | None]], closed: bool
) -> dict[str, float]:
    """Flat counters: the adapter's own (``pages_staged``, ``pages_write_skipped``,
    ``errors.<op>``, ...), and each tier's under its prefix (``kv.``, ``side.``): its runner's
    (``kv.host.blocks_refused.write``, ... kvcore's one vocabulary) and its backend's."""
    out = counters.snapshot()
    for prefix, tier in tiers:
        if tier is not None:
            out.update(tier.stats(prefix, closed))
    for old, terms in _DEPRECATED.items():
        total = 0.0
        for term in terms:
            sign, name = (-1.0, term[1:]) if term.startswith("-") else (1.0, term)
            total += sign * sum(out.get(f"{tier}.host.{name}", 0.0) for tier in ("kv", "side"))
        out[old] = total
    return out
