"""Thread-safe counters, log-once, latency histograms, and their Prometheus exposition.

:class:`Counters` and :class:`OnceLogger` are what a backend needs for its ``kvcore_stats``
hook and its failure log; :class:`Metrics` is kvcore's own per-operation accounting.

Prometheus exposition goes through ``prometheus-client``: :class:`PrometheusCollector` is a
collector an engine registers in its own ``CollectorRegistry`` (beside its other metrics), and
:func:`serve_prometheus` is the opt-in HTTP endpoint, on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvcore.tenants import MAX_TENANTS, OTHER_TENANTS

# prometheus-client is imported where exposition is asked for (families, serve_prometheus), not
# by every process that imports kvcore and only counts
if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

__all__ = [
    "LATENCY_BUCKETS_S",
    "Counters",
    "Metrics",
    "OnceLogger",
    "PrometheusCollector",
    "TenantCounters",
    "serve_prometheus",
]


class Counters:
    """Named, monotonically increasing counts, safe to bump from any thread.

    A backend keeps one and returns :meth:`snapshot` from its ``kvcore_stats`` hook.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: defaultdict[str, float] = defaultdict(float)

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

    def warning(self, key: Hashable, msg: str, *args: object, **kwargs: Any) -> bool:
        """Log ``msg % args``; True when it went out at warning level (first time for ``key``)."""
        with self._lock:
            first = key not in self._seen
            self._seen.add(key)
        if first:
            self.logger.warning(msg, *args, **kwargs)
        else:
            kwargs.pop("exc_info", None)
            self.logger.debug(msg, *args, **kwargs)
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


class _Op:
    """One operation's counters (by name) and its latency histogram, if it has one."""

    __slots__ = ("counters", "latency")

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.latency: _Histogram | None = None


#: tenants counted by name (a label value each); later ones are counted together as "other"
MAX_TENANT_LABELS = MAX_TENANTS


class TenantCounters:
    """Counts per tenant and operation (the blocks a request asked for and those answered),
    for figures per tenant: a query's or a read's ``blocks_done`` are its hits, its
    ``blocks`` less them its misses; an admission's, the blocks admitted. Tenants are the
    operator's names (a request's ``tenant``, never a salt); past :data:`MAX_TENANT_LABELS`
    of them, the rest count as ``other``, so a metric's label values stay bounded.

    .. versionadded:: 0.3
    """

    def __init__(self, max_tenants: int = MAX_TENANT_LABELS) -> None:
        self._lock = threading.Lock()
        self._max = max_tenants
        self._counts: dict[tuple[str, str], dict[str, float]] = {}  # (tenant, op) -> counts
        self._tenants: set[str] = set()

    def add(self, tenant: str, op: str, **counts: float) -> None:
        with self._lock:
            if tenant not in self._tenants:
                if len(self._tenants) >= self._max:
                    tenant = OTHER_TENANTS
                self._tenants.add(tenant)
            found = self._counts.get((tenant, op))
            if found is None:
                found = self._counts[(tenant, op)] = {}
            for name, value in counts.items():
                found[name] = found.get(name, 0.0) + value

    def snapshot(self) -> dict[str, float]:
        """Flat ``{"tenant_<name>.<op>.<tenant>": value}``."""
        with self._lock:
            return {
                f"tenant_{name}.{op}.{tenant}": v
                for (tenant, op), counts in sorted(self._counts.items())
                for name, v in counts.items()
            }

    def families(self, prefix: str, labels: Mapping[str, str]) -> list[Metric]:
        """``<prefix>_tenant_<name>_total{<labels>,tenant,op}`` counters."""
        from prometheus_client.core import CounterMetricFamily

        with self._lock:
            items = sorted((k, dict(v)) for k, v in self._counts.items())
        by_name: defaultdict[str, list[tuple[str, str, float]]] = defaultdict(list)
        for (tenant, op), counts in items:
            for name, v in counts.items():
                by_name[name].append((tenant, op, v))
        out: list[Metric] = []
        for name in sorted(by_name):
            family = CounterMetricFamily(
                f"{prefix}_tenant_{_sanitize(name)}",
                f"{name.replace('_', ' ')}, per tenant and operation",
                labels=[*labels, "tenant", "op"],
            )
            for tenant, op, v in by_name[name]:
                family.add_metric([*labels.values(), tenant, op], v)
            out.append(family)
        return out


class Metrics:
    """Counters by name and a latency histogram, per operation.

    One lock guards everything: updates are a few dict operations, far cheaper than the I/O
    they describe, and a single lock keeps snapshots consistent. Kept per operation (not keyed
    by ``(name, op)`` pairs) so an update builds no key: every call of every backend and every
    engine-side job passes here.
    """

    def __init__(self, prefix: str = "kvcore", labels: Mapping[str, str] | None = None) -> None:
        self.prefix = prefix
        self.labels = dict(labels or {})
        self._lock = threading.Lock()
        self._ops: dict[str, _Op] = {}
        #: the same calls counted per tenant, for requests that name one (``0.3``)
        self.tenants = TenantCounters()

    def _op(self, op: str) -> _Op:
        """``op``'s figures (created at its first update; the caller holds the lock)."""
        found = self._ops.get(op)
        if found is None:
            found = self._ops[op] = _Op()
        return found

    def add(self, op: str, **counts: float) -> None:
        with self._lock:
            counters = self._op(op).counters
            for name, value in counts.items():
                counters[name] = counters.get(name, 0.0) + value

    def observe(self, op: str, seconds: float, **counts: float) -> None:
        """Record one call's latency and its counters atomically."""
        with self._lock:
            stats = self._op(op)
            hist = stats.latency
            if hist is None:
                hist = stats.latency = _Histogram()
            hist.observe(seconds)
            counters = stats.counters
            for name, value in counts.items():
                counters[name] = counters.get(name, 0.0) + value

    def get(self, name: str, op: str) -> float:
        with self._lock:
            stats = self._ops.get(op)
            return 0.0 if stats is None else stats.counters.get(name, 0.0)

    def _counts(self) -> dict[tuple[str, str], float]:
        """Every counter as ``{(name, op): value}`` (the caller holds the lock)."""
        return {(name, op): v for op, s in self._ops.items() for name, v in s.counters.items()}

    def snapshot(self) -> dict[str, float]:
        """Flat ``{"<name>.<op>": value}`` plus ``latency_count``/``latency_sum_s`` per op."""
        with self._lock:
            out = {f"{name}.{op}": v for (name, op), v in self._counts().items()}
            for op, s in self._ops.items():
                if s.latency is not None:
                    out[f"latency_count.{op}"] = s.latency.count
                    out[f"latency_sum_s.{op}"] = s.latency.sum
        out.update(self.tenants.snapshot())
        return dict(sorted(out.items()))

    def families(self, extra: Mapping[str, float] | None = None) -> list[Metric]:
        """The counters, histograms and ``extra`` gauges as prometheus-client metric families.

        Counters become ``<prefix>_<name>_total{<labels>,op}``, latencies one
        ``<prefix>_latency_seconds`` histogram per op, and each ``extra`` value a gauge
        ``<prefix>_<name>``.
        """
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        with self._lock:
            counters = self._counts()
            hists = {
                op: (list(s.latency.buckets), s.latency.sum)
                for op, s in self._ops.items()
                if s.latency is not None
            }
        names = [*self.labels, "op"]
        values = list(self.labels.values())
        by_name: defaultdict[str, list[tuple[str, float]]] = defaultdict(list)
        for (name, op), v in counters.items():
            by_name[name].append((op, v))
        out: list[Metric] = []
        for name in sorted(by_name):
            family = CounterMetricFamily(
                f"{self.prefix}_{_sanitize(name)}",
                _COUNTER_HELP.get(name, f"{name.replace('_', ' ')}, per operation"),
                labels=names,
            )
            for op, v in sorted(by_name[name]):
                family.add_metric([*values, op], v)
            out.append(family)
        if hists:
            hist = HistogramMetricFamily(
                f"{self.prefix}_latency_seconds", "latency of one call, per operation", labels=names
            )
            for op in sorted(hists):
                buckets, total = hists[op]
                cumulative, points = 0, []
                for bound, n in zip((*LATENCY_BUCKETS_S, float("inf")), buckets, strict=True):
                    cumulative += n
                    points.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
                hist.add_metric([*values, op], points, total)
            out.append(hist)
        out += self.tenants.families(self.prefix, self.labels)
        per_tenant: defaultdict[str, list[tuple[str, float]]] = defaultdict(list)
        for name, v in sorted((extra or {}).items()):
            figure, dot, tenant = name.partition(".")
            if dot and "tenant_" in figure:  # a figure per tenant (tenant_gauges)
                per_tenant[figure].append((tenant, float(v)))
                continue
            gauge = GaugeMetricFamily(
                f"{self.prefix}_{_sanitize(name)}", name.replace("_", " "), labels=list(self.labels)
            )
            gauge.add_metric(values, float(v))
            out.append(gauge)
        for figure, by_tenant in sorted(per_tenant.items()):
            gauge = GaugeMetricFamily(
                f"{self.prefix}_{_sanitize(figure)}",
                f"{figure.replace('_', ' ')}, per tenant",
                labels=[*self.labels, "tenant"],
            )
            for tenant, v in by_tenant:
                gauge.add_metric([*values, tenant], v)
            out.append(gauge)
        return out

    def prometheus(self, extra: Mapping[str, float] | None = None) -> str:
        """Prometheus text exposition (version 0.0.4) of every counter, histogram and gauge."""
        from prometheus_client import generate_latest

        return generate_latest(_Families(lambda: self.families(extra))).decode()


#: Help text of the counters kvcore itself keeps (others get one derived from their name).
_COUNTER_HELP = {
    "calls": "backend calls, per operation",
    "tasks": "tasks submitted, per operation",
    "blocks": "blocks moved, per operation",
    "blocks_done": "blocks the backend answered for, per operation",
    "hits": "blocks found in storage",
    "misses": "blocks not found in storage",
    "errors": "calls or tasks that failed (a failure is answered as a miss), per operation",
    "invalid_results": "backend answers that broke the hook contract, per operation",
    "deadline_missed": "calls or tasks answered at their deadline, per operation",
    "rejected": "tasks refused (queue full, caches cleared, closing), per operation",
    "bytes": "bytes moved, per operation",
}


class _Families:
    """A one-shot collector over a function returning metric families."""

    def __init__(self, produce: Callable[[], list[Metric]]) -> None:
        self._produce = produce

    def collect(self) -> Iterator[Metric]:
        yield from self._produce()


class PrometheusCollector:
    """A prometheus-client collector of kvcore's metrics, for an engine's own registry.

    ``target`` is a :class:`~kvcore.transfer.TransferManager` (its task counters, latencies
    and memory, and those of its backend) or an opened :class:`~kvcore.Backend` (the facade's
    per-call counters and the backend's own ``kvcore_stats`` as ``kvcore_backend_backend_*``
    gauges). Each scrape reads the current values::

        from prometheus_client import CollectorRegistry
        registry = CollectorRegistry()          # or prometheus_client.REGISTRY
        registry.register(PrometheusCollector(manager))

    Two targets with the same metric names (two managers of one process) need distinct
    registries, or one collector per process that the engine labels itself.
    """

    def __init__(self, target: Any) -> None:
        self.target = target

    def describe(self) -> list[Metric]:
        # nothing up front: registering must not scrape a backend (it may be remote)
        return []

    def collect(self) -> Iterator[Metric]:
        yield from _target_families(self.target)


def _target_families(target: Any) -> list[Metric]:
    metrics: Metrics | None = getattr(target, "metrics", None)
    if metrics is None:
        raise TypeError(f"{target!r} has no kvcore metrics (a TransferManager or a Backend)")
    out: list[Metric] = []
    if hasattr(target, "memory_bytes"):  # a transfer manager: its own, then its backend's
        out += metrics.families(extra=target.memory_bytes())
        backend = getattr(target, "backend", None)
        if backend is not None:
            out += _target_families(backend)
        return out
    stats = target.stats() if hasattr(target, "stats") else {}
    # the backend's own gauges, and the read rate the facade measures (read_bytes_per_s,
    # read_per_call_s: what the load-or-recompute decision weighs a load with)
    own = {k: v for k, v in stats.items() if k.startswith(("backend_", "read_"))}
    return metrics.families(extra=own)


def serve_prometheus(
    target: Any, port: int, host: str = "127.0.0.1", registry: CollectorRegistry | None = None
) -> tuple[Any, threading.Thread]:
    """Serve ``target``'s metrics over HTTP (``GET /metrics``) from a daemon thread.

    Opt-in: kvcore never opens a port by itself. Binds to 127.0.0.1 unless ``host`` says
    otherwise (a cache's counters are no business of the network). ``port=0`` picks a free
    port (``server.server_port``). Returns the server (``server.shutdown()`` stops it) and its
    thread. Pass ``registry`` to serve an engine's registry with the collector added to it.
    """
    from prometheus_client import CollectorRegistry, start_http_server

    if registry is None:
        registry = CollectorRegistry()
    registry.register(PrometheusCollector(target))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return server, thread


def _sanitize(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)
