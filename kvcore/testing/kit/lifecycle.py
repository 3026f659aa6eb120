"""The hooks around the data path: a token-index flush moves and drops no data, stats and raw
baselines are flat mappings of numbers, and close is idempotent."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np

from kvcore.schemas import Capabilities
from kvcore.testing.harness import Harness
from kvcore.testing.kit.fixtures import KitFixtures, _hook_caller, _require_hook
from kvcore.testing.kit.marks import exercises

__all__ = ["LifecycleTests"]


class LifecycleTests(KitFixtures):
    """Flush, stats, raw baseline and close: safe to call, with answers of the right shape."""

    # -- token index and lifecycle ---------------------------------------------------------

    @exercises("kvcore_flush_token_index", "kvcore_write", "kvcore_query")
    def test_flush_token_index_is_safe(self, harness: Harness, capabilities: Capabilities) -> None:
        seq = harness.new_sequence(3)
        assert harness.write(seq) == 3
        for resident in (True, False):
            n = harness.backend.flush_token_index(harness.request(seq, 1), resident)
            assert 0 <= n <= 2
            if not capabilities.token_index:
                assert n == 0
        assert harness.query(seq) == 3, "a flush must not move or drop data"

    @exercises("kvcore_stats", "kvcore_write", "kvcore_read")
    def test_stats_are_a_flat_mapping_of_numbers(self, harness: Harness) -> None:
        seq = harness.new_sequence(2)
        harness.write(seq)
        harness.read(seq)
        backend = harness.backend
        if backend.implements("kvcore_stats"):
            own = _hook_caller(backend, "kvcore_stats")()
            assert isinstance(own, Mapping), f"kvcore_stats returned a {type(own).__name__}"
            bad = {k: v for k, v in own.items() if not (isinstance(k, str) and _is_number(v))}
            assert not bad, f"kvcore_stats must map str to numbers; these are not: {bad!r}"
        stats = backend.stats()
        assert stats["calls.write"] == 1
        assert stats["calls.read"] == 1
        bad = {k: v for k, v in stats.items() if not (isinstance(k, str) and _is_number(v))}
        assert not bad, f"Backend.stats() must map str to numbers; these are not: {bad!r}"

    @exercises("kvcore_raw_baseline")
    def test_raw_baseline_reports_speeds(self, harness: Harness) -> None:
        backend = harness.backend
        _require_hook(backend, "kvcore_raw_baseline")
        data = np.frombuffer(bytearray(np.random.default_rng().bytes(4 << 20)), dtype=np.uint8)
        before = data.copy()
        figures = backend.raw_baseline(data.ctypes.data, data.nbytes, data.nbytes // 16)
        assert isinstance(figures, Mapping)
        bad = {k: v for k, v in figures.items() if not (isinstance(k, str) and _is_number(v))}
        assert not bad, f"kvcore_raw_baseline must map str to numbers; these are not: {bad!r}"
        for name in ("write_gbps", "read_gbps"):
            if name in figures:
                assert math.isfinite(figures[name]) and figures[name] > 0, (name, figures)
        if "read_gbps" in figures:
            assert np.array_equal(data, before), "the raw baseline changed the bytes it was given"

    @exercises("kvcore_close")
    def test_close_is_idempotent(self, harness: Harness) -> None:
        harness.backend.close()
        harness.backend.close()


# -- helpers ---------------------------------------------------------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
