"""Thread-safe counters reported through ``kvcore_stats``, and log-once for SDK failures."""

from __future__ import annotations

import logging
import threading
from collections import Counter

log = logging.getLogger("kv_attentionstore")


class Counters:
    """Named monotonically increasing counts plus a log-the-first-of-each-kind failure log."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._seen: set[tuple[str, str]] = set()

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._counts[name] += value

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {k: float(v) for k, v in self._counts.items()}

    def sdk_failure(self, op: str, exc: BaseException, task_id: str) -> None:
        """Count an SDK failure; warn on the first of each (op, error type), debug after."""
        kind = type(exc).__name__
        with self._lock:
            self._counts[f"{op}_sdk_errors"] += 1
            first = (op, kind) not in self._seen
            self._seen.add((op, kind))
        if first:
            log.warning(
                "AttentionStore %s failed (task %r): %s: %s; counted as a miss (further %s "
                "errors in %s are logged at debug level)",
                op,
                task_id,
                kind,
                exc,
                kind,
                op,
            )
        else:
            log.debug("AttentionStore %s failed (task %r): %r", op, task_id, exc)
