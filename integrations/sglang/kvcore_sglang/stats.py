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


def kvcore_counters(
    counters: kvcore.Counters, tiers: Iterable[tuple[str, Tier | None]], closed: bool
) -> dict[str, float]:
    """Flat counters: the adapter's (``pages_*``, ``errors.<op>``, ``failures.<op>``) and
    each opened tier's kvcore counters under its prefix (``kv.``, ``side.``)."""
    out = counters.snapshot()
    for prefix, tier in tiers:
        if tier is not None:
            out.update(tier.stats(prefix, closed))
    # the 0.1 name of the facade's refusal count (kv. and side. together), until 0.2
    out["pages_refused"] = out.get("kv.blocks_refused.admit", 0.0) + out.get(
        "side.blocks_refused.admit", 0.0
    )
    return out
