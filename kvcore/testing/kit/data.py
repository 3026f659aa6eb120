"""Round trips: what is written reads back byte for byte (every dtype, empty requests, large
batches), writes are idempotent and never tear a block between versions, and a persistent
store keeps its data across a reopen."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvcore.schemas import CacheDType, Capabilities
from kvcore.testing.harness import Harness, blocks_equal
from kvcore.testing.kit.fixtures import KitFixtures, small_layout
from kvcore.testing.kit.marks import DATA_HOOKS, exercises, requires

__all__ = ["RoundTripTests"]


_DTYPES = [d.value for d in CacheDType]


class RoundTripTests(KitFixtures):
    """Data written reads back exactly, however often and in whatever batch it was written."""

    # -- round trips -----------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", _DTYPES)
    @exercises(*DATA_HOOKS)
    def test_round_trip_is_byte_exact(
        self, open_harness: Callable[..., Harness], capabilities: Capabilities, dtype: str
    ) -> None:
        if CacheDType(dtype).has_scales and not capabilities.scales:
            pytest.skip("backend declares scales=False")
        h = open_harness(small_layout(dtype))
        seq = h.new_sequence(5)
        assert h.write(seq) == 5
        assert h.query(seq) == 5
        done, got = h.read(seq)
        assert done == 5
        assert blocks_equal(got, h.payload(seq, 0, 5)) == []

    @exercises(*DATA_HOOKS)
    def test_empty_request(self, harness: Harness) -> None:
        seq = harness.new_sequence(2)
        assert harness.query(seq, 0, 0) == 0
        assert harness.write(seq, 0, 0) == 0
        assert harness.read(seq, 0, 0)[0] == 0

    @exercises("kvcore_write", "kvcore_read")
    def test_large_batch(self, harness: Harness) -> None:
        seq = harness.new_sequence(32)
        assert harness.write(seq) == 32
        harness.assert_reads_back(seq, 32)

    # -- writes ----------------------------------------------------------------------------

    @exercises(*DATA_HOOKS)
    def test_write_is_idempotent(self, harness: Harness) -> None:
        seq = harness.new_sequence(4)
        assert harness.write(seq) == 4
        assert harness.write(seq) == 4
        assert harness.query(seq) == 4
        harness.assert_reads_back(seq, 4)

    @exercises("kvcore_write", "kvcore_read")
    def test_rewrite_never_mixes_versions(self, harness: Harness) -> None:
        seq = harness.new_sequence(3)
        assert harness.write(seq, version=0) == 3
        assert harness.write(seq, version=1) == 3
        done, got = harness.read(seq)
        assert done == 3
        old, new = harness.payload(seq, 0, 3, 0), harness.payload(seq, 0, 3, 1)
        for i in range(3):
            for j in range(len(harness.parts)):
                assert got[i][j] in (old[i][j], new[i][j]), f"block {i} part {j} is torn"

    @requires(persistent=True)
    @exercises(*DATA_HOOKS, "kvcore_close")
    def test_data_survives_reopen(self, open_harness: Callable[..., Harness]) -> None:
        h = open_harness()
        seq = h.new_sequence(3)
        assert h.write(seq) == 3
        h.backend.close()
        h2 = open_harness()
        assert h2.query(seq) == 3
        done, got = h2.read(seq)
        assert done == 3
        assert blocks_equal(got, h2.payload(seq, 0, 3)) == []
