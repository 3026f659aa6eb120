"""Thread-safe counters, log-once, and latency histograms with a Prometheus text exporter.

:class:`Counters` and :class:`OnceLogger` are what a backend needs for its ``kvcore_stats``
hook and its failure log; :class:`Metrics` is kvcore's own per-operation accounting.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Mapping

__all__ = ["LATENCY_BUCKETS_S", "Counters", "Metrics", "OnceLogger"]


class Counters:
    """Named, monotonically increasing counts, safe to bump from any thread.

    A backend keeps one and returns :meth:`snapshot` from its ``kvcore_stats`` hook.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._counts[name] += value

    def get(self, name: str) -> float:
        with self._lock:
            return float(self._counts.get(name, 0))

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {k: float(v) for k, v in self._counts.items()}


class OnceLogger:
    """Log the first occurrence of each kind of event at warning level, later ones at debug.

    A backend that fails the same way ten thousand times a second must not flood the
    engine's log, but its first failure of each kind must be seen with full context.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def warning(self, key: Hashable, msg: str, *args: object, **kwargs: object) -> bool:
        """Log ``msg % args``; True when it went out at warning level (first time for ``key``)."""
        with self._lock:
            first = key not in self._seen
            self._seen.add(key)
        if first:
            self.logger.warning(msg, *args, **kwargs)  # type: ignore[arg-type]
        else:
            kwargs.pop("exc_info", None)
            self.logger.debug(msg, *args, **kwargs)  # type: ignore[arg-type]
        return first


#: Upper bounds (seconds) of the latency histogram buckets; +Inf is implicit.
LATENCY_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


class _Histogram:
    __slots__ = ("buckets", "count", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, value)] += 1
        self.count += 1
        self.sum += value


class Metrics:
    """Counters keyed by ``(name, op)`` and latency histograms keyed by ``op``.

    One lock guards everything: updates are a few dict operations, far cheaper than the I/O
    they describe, and a single lock keeps snapshots consistent.
    """

    def __init__(self, prefix: str = "kvcore", labels: Mapping[str, str] | None = None) -> None:
        self.prefix = prefix
        self.labels = dict(labels or {})
        self._lock = threading.Lock()
        self._counters: defaultdict[tuple[str, str], float] = defaultdict(float)
        self._latency: dict[str, _Histogram] = {}

    def add(self, op: str, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                self._counters[(name, op)] += value

    def observe(self, op: str, seconds: float, **counts: float) -> None:
        """Record one call's latency and its counters atomically."""
        with self._lock:
            hist = self._latency.get(op)
            if hist is None:
                hist = self._latency[op] = _Histogram()
            hist.observe(seconds)
            for name, value in counts.items():
                self._counters[(name, op)] += value

    def get(self, name: str, op: str) -> float:
        with self._lock:
            return self._counters.get((name, op), 0.0)

    def snapshot(self) -> dict[str, float]:
        """Flat ``{"<name>.<op>": value}`` plus ``latency_count``/``latency_sum_s`` per op."""
        with self._lock:
            out = {f"{name}.{op}": v for (name, op), v in self._counters.items()}
            for op, h in self._latency.items():
                out[f"latency_count.{op}"] = h.count
                out[f"latency_sum_s.{op}"] = h.sum
            return dict(sorted(out.items()))

    def prometheus(self, extra: Mapping[str, float] | None = None) -> str:
        """Prometheus text exposition (version 0.0.4) of every counter and histogram."""
        with self._lock:
            counters = dict(self._counters)
            hists = {op: (list(h.buckets), h.count, h.sum) for op, h in self._latency.items()}
        lines: list[str] = []
        by_name: defaultdict[str, list[tuple[str, float]]] = defaultdict(list)
        for (name, op), v in counters.items():
            by_name[name].append((op, v))
        for name in sorted(by_name):
            metric = f"{self.prefix}_{name}_total"
            lines.append(f"# TYPE {metric} counter")
            for op, v in sorted(by_name[name]):
                lines.append(f"{metric}{self._fmt_labels(op=op)} {_num(v)}")
        if hists:
            metric = f"{self.prefix}_latency_seconds"
            lines.append(f"# TYPE {metric} histogram")
            for op in sorted(hists):
                buckets, count, total = hists[op]
                cumulative = 0
                for bound, n in zip((*LATENCY_BUCKETS_S, float("inf")), buckets, strict=True):
                    cumulative += n
                    le = "+Inf" if bound == float("inf") else repr(bound)
                    lines.append(f"{metric}_bucket{self._fmt_labels(op=op, le=le)} {cumulative}")
                lines.append(f"{metric}_sum{self._fmt_labels(op=op)} {_num(total)}")
                lines.append(f"{metric}_count{self._fmt_labels(op=op)} {count}")
        for name, v in sorted((extra or {}).items()):
            metric = f"{self.prefix}_{_sanitize(name)}"
            lines.append(f"# TYPE {metric} gauge")
            lines.append(f"{metric}{self._fmt_labels()} {_num(v)}")
        return "\n".join(lines) + "\n"

    def _fmt_labels(self, **more: str) -> str:
        items: Iterable[tuple[str, str]] = [*self.labels.items(), *more.items()]
        body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in items)
        return "{" + body + "}" if body else ""


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sanitize(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)
