"""The connector's counters as vLLM connector stats (summed across workers and intervals).

Every value is a plain float counter: vLLM ships the dict from the workers to the scheduler
and the frontend, sums it across workers with :meth:`aggregate`, and logs :meth:`reduce` as
``KV Transfer metrics: ...`` (``--disable-log-stats`` off). Names:

- ``lookup_*``: scheduler-side existence checks (``blocks`` asked, ``hit_blocks`` found on
  every rank, ``errors`` backend failures);
- ``load_*`` / ``save_*``: worker tasks (``blocks`` asked, ``done_blocks``, ``failed_blocks``
  reported to vLLM for recomputation, ``bytes``, ``seconds``); ``load_measured_bytes`` /
  ``load_measured_seconds``: the loads that were no client's first read, what the scheduler's
  read rate learns from where the workers run in other processes;
- ``kvcore.<counter>.<op>``: kvcore's own TransferManager and backend-facade counters (hits,
  misses, bytes, errors, deadline misses, latency sums), as deltas;
- ``lookup_skipped`` / ``lookup_pauses``: lookups answered as misses without asking, while a
  backend that failed or answered slowly is left alone (``lookup_backoff_s``);
- ``scheduler_hook_seconds`` / ``worker_hook_seconds``: time spent inside the connector's calls
  on vLLM's step path (loads excluded), with ``scheduler_steps`` / ``worker_steps``;
- ``backend_open_failures``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["CounterSet", "KVCoreConnectorStats", "delta"]


class KVCoreConnectorStats(KVConnectorStats):
    """vLLM's stats container for KVCoreConnector: a flat dict of summed counters."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVCoreConnectorStats:
        for name, value in (other.data or {}).items():
            self.data[name] = float(self.data.get(name, 0.0)) + float(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, value in sorted(self.data.items()):
            out[name] = int(value) if float(value).is_integer() else round(float(value), 6)
        asked = self.data.get("lookup_blocks", 0.0)
        if asked:
            out["lookup_hit_rate"] = round(self.data.get("lookup_hit_blocks", 0.0) / asked, 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CounterSet:
    """Counters bumped from vLLM's threads and kvcore's callbacks; drained once per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}
        self._total: dict[str, float] = {}

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                if value:
                    self._pending[name] = self._pending.get(name, 0.0) + value
                    self._total[name] = self._total.get(name, 0.0) + value

    def merge(self, counts: Mapping[str, float]) -> None:
        self.add(**{k: v for k, v in counts.items() if v})

    def take(self) -> dict[str, float]:
        """Counts since the last take (what one step reports)."""
        with self._lock:
            out, self._pending = self._pending, {}
        return out

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._total)


def delta(now: Mapping[str, Any], before: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """Increments of monotonically increasing counters since ``before``, with ``prefix``."""
    out = {}
    for name, value in now.items():
        diff = float(value) - float(before.get(name, 0.0))
        if diff:
            out[f"{prefix}{name}"] = diff
    return out
