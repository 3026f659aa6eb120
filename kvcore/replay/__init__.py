"""Replay a production request trace through a store and report what its capacity buys.

``kvcore replay TRACE`` (and :func:`replay`) serves a trace in the Mooncake JSONL format
(:mod:`kvcore.replay.trace`) through a real :class:`~kvcore.transfer.TransferManager` and
backend with real bytes (:mod:`kvcore.replay.io`), or through a model of kv_file's store on
metadata only (``simulate=True``: the backend's own store model, :mod:`kvcore.replay.model`), and reports the prefix hit rate
in blocks and tokens against the trace's maximum (unlimited capacity) and the offline optimum
at the same capacity (Belady's), the bytes written per block hit, evictions, read latency and
wall time.

Example::

    from kvcore.replay import load_trace, replay
    trace = load_trace("mooncake_conversation_trace.jsonl")
    report = replay(trace, capacity_blocks=5859, policy="adaptive", simulate=True)
    print(report["hit_rate_blocks"], report["of_optimum"])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvcore.admission import PolicyName
from kvcore.replay.capacity import capacity_holding
from kvcore.replay.model import Tally, optimal_hits, simulate, unlimited_hits
from kvcore.replay.trace import (
    Trace,
    TraceError,
    TraceRequest,
    flood_trace,
    load_trace,
    merge_traces,
)
from kvcore.tenants import TenantSettings

__all__ = [
    "Bounds",
    "Tally",
    "Trace",
    "TraceError",
    "TraceRequest",
    "capacity_holding",
    "flood_trace",
    "load_trace",
    "merge_traces",
    "replay",
    "simulate",
]


class Bounds:
    """The trace's maximum and its optimum per capacity, each computed once."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self._maximum: Tally | None = None
        self._optimum: dict[int, Tally] = {}

    @property
    def maximum(self) -> Tally:
        if self._maximum is None:
            self._maximum = unlimited_hits(self.trace)
        return self._maximum

    def optimum(self, capacity_blocks: int) -> Tally:
        if capacity_blocks not in self._optimum:
            self._optimum[capacity_blocks] = optimal_hits(self.trace, capacity_blocks)
        return self._optimum[capacity_blocks]


def replay(
    trace: Trace,
    *,
    capacity_blocks: int,
    policy: PolicyName = "adaptive",
    simulate_only: bool = False,
    backend: str = "file",
    config: Mapping[str, Any] | None = None,
    block_bytes: int = 16 << 10,
    high_watermark: float = 1.0,
    low_watermark: float = 1.0,
    doorkeeper_factor: float = 2.0,
    sample_rate: float = 1 / 16,
    bounds: Bounds | None = None,
    progress: Callable[[int], None] | None = None,
    tenants: TenantSettings | None = None,
) -> dict[str, Any]:
    """Replay ``trace`` at ``capacity_blocks`` with admission ``policy``; returns the report.

    Watermarks default to 1.0: the store holds exactly ``capacity_blocks`` and evicts one LRU
    block per block it admits when full, so "capacity" means what it says.

    A trace of several tenants (:func:`merge_traces`) is reported per tenant too
    (``tenants`` in the report); ``tenants`` gives their shares of the store, in bytes of
    blocks of ``block_bytes`` (an I/O replay scales them to the bytes a block takes in the
    backend, which must have a ``tenants`` setting, as kv_file has).

    .. versionchanged:: 0.3 ``tenants``, and the report's per-tenant counts
    """
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    bounds = bounds or Bounds(trace)
    store = {
        # no periodic full scans: one could reorder what a replay counts (a backend without
        # the setting is not given it)
        "rescan_interval_s": 0,
        "high_watermark": high_watermark,
        "low_watermark": low_watermark,
        "admission_doorkeeper": doorkeeper_factor,
        "admission_sample_rate": sample_rate,
    }
    t0 = time.monotonic()
    if simulate_only:
        tally, _ = simulate(
            trace,
            capacity_blocks,
            policy,
            block_bytes=block_bytes,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            doorkeeper_factor=doorkeeper_factor,
            sample_rate=sample_rate,
            progress=progress,
            backend=backend,
            tenants=tenants,
        )
        mode = "simulate"
    else:
        from kvcore.replay.io import IOReplay  # numpy cache and a backend: only when used

        run = IOReplay(
            trace,
            backend,
            config or {},
            capacity_blocks=capacity_blocks,
            policy=policy,
            block_bytes=block_bytes,
            store_settings=store,
            tenants=tenants,
        )
        tally = run.run(progress)
        mode = "io"
    wall = time.monotonic() - t0
    return _report(trace, tally, bounds, mode, policy, capacity_blocks, block_bytes, backend, wall)


def _report(
    trace: Trace,
    tally: Tally,
    bounds: Bounds,
    mode: str,
    policy: str,
    capacity_blocks: int,
    block_bytes: int,
    backend: str,
    wall_s: float,
) -> dict[str, Any]:
    best, opt = bounds.maximum, bounds.optimum(capacity_blocks)
    lat = np.asarray(tally.read_latency_s) * 1e3
    rate = tally.hit_rate_blocks
    return {
        "mode": mode,
        "backend": backend if mode == "io" else "model of kv_file",
        "policy": policy,
        "capacity_blocks": capacity_blocks,
        "capacity_tokens": capacity_blocks * trace.tokens_per_block,
        "block_bytes": block_bytes,
        "requests": tally.requests,
        "block_refs": tally.block_refs,
        "block_hits": tally.block_hits,
        "hit_rate_blocks": rate,
        "hit_rate_tokens": tally.hit_rate_tokens,
        "max_hit_rate_blocks": best.hit_rate_blocks,
        "max_hit_rate_tokens": best.hit_rate_tokens,
        "optimum_hit_rate_blocks": opt.hit_rate_blocks,
        "optimum_hit_rate_tokens": opt.hit_rate_tokens,
        "of_max": rate / best.hit_rate_blocks if best.hit_rate_blocks else 0.0,
        "of_optimum": rate / opt.hit_rate_blocks if opt.hit_rate_blocks else 0.0,
        "blocks_written": tally.blocks_written,
        "bytes_written": tally.bytes_written,
        "bytes_written_per_block_hit": (
            tally.bytes_written / tally.block_hits if tally.block_hits else None
        ),
        "blocks_refused": tally.blocks_refused,
        "evictions": tally.evictions,
        "read_latency_ms_p50": float(np.percentile(lat, 50)) if lat.size else None,
        "read_latency_ms_p99": float(np.percentile(lat, 99)) if lat.size else None,
        "wall_s": wall_s,
        "mismatches": tally.mismatches,
        "errors": tally.errors,
        "error_samples": tally.error_samples,
        "tenants": {
            name: {
                "requests": own.requests,
                "block_refs": own.block_refs,
                "block_hits": own.block_hits,
                "hit_rate_blocks": own.hit_rate_blocks,
                "hit_rate_tokens": own.hit_rate_tokens,
                "blocks_written": own.blocks_written,
                "blocks_refused": own.blocks_refused,
                "evictions": own.evictions,
            }
            for name, own in sorted(tally.tenants.items())
        },
    }
