"""Capacity and admission: a write larger than the store's declared capacity never
acknowledges blocks it could not keep, and ``kvcore_admit`` answers a leading run and counts
blocks already stored as admitted."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvcore.testing.harness import Harness, Sequence_, blocks_equal
from kvcore.testing.kit.fixtures import (
    DeclaredCapacity,
    KitFixtures,
    _hook_caller,
    _require_hook,
    capacity_layout,
)
from kvcore.testing.kit.marks import DATA_HOOKS, exercises

__all__ = ["CapacityTests"]


# Batches larger than this would make the capacity test slow: declare a small capacity.
_CAPACITY_TEST_MAX_BYTES = 64 << 20


class CapacityTests(KitFixtures):
    """What a full store acknowledges is kept; admission answers what it would store."""

    # -- capacity --------------------------------------------------------------------------

    @exercises(*DATA_HOOKS)
    def test_oversize_batch_acknowledges_only_what_it_keeps(
        self,
        open_harness: Callable[..., Harness],
        backend_capacity: DeclaredCapacity | None,
    ) -> None:
        """A write larger than the store's capacity must not acknowledge blocks it could not
        keep (or evicted again within the same batch): a later query counts what write
        acknowledged. Then batches of a third of the capacity, one after another: each
        acknowledged run is there right after, while older batches may be evicted."""
        if backend_capacity is None:
            pytest.skip(
                "no declared capacity (config without `capacity_bytes`; override the "
                "`backend_capacity` fixture to declare one)"
            )
        cap = backend_capacity
        if 2 * cap.nbytes > _CAPACITY_TEST_MAX_BYTES:
            pytest.fail(
                f"backend_capacity declares {cap.nbytes} bytes; declare at most "
                f"{_CAPACITY_TEST_MAX_BYTES // 2} (the test writes twice the capacity)"
            )
        layout = capacity_layout()
        block = layout.block_bytes
        n = 2 * cap.nbytes // block + 1
        h = open_harness(capacity_layout(max(n, 16)), config=cap.config)
        seq = h.new_sequence(n)
        acked = _written_and_kept(
            h, seq, f"{n} blocks ({n * block} bytes, about twice the declared capacity)"
        )
        done, got = h.read(seq, 0, int(acked))
        assert done == acked, f"read restores {int(done)} of the {int(acked)} acknowledged blocks"
        assert blocks_equal(got, h.payload(seq, 0, int(acked))) == []
        third = max(1, cap.nbytes // (3 * block))
        for k in range(6):
            written_before = k * third * block + n * block
            _written_and_kept(
                h,
                h.new_sequence(third),
                f"batch {k} of {third} blocks (a third of the capacity, after {written_before} "
                "bytes already written)",
            )

    # -- admission ---------------------------------------------------------------------------

    @exercises("kvcore_admit", "kvcore_write", "kvcore_read")
    def test_admission_answers_a_leading_run_and_admits_what_is_stored(
        self, harness: Harness
    ) -> None:
        backend = harness.backend
        _require_hook(backend, "kvcore_admit")
        admit = _hook_caller(backend, "kvcore_admit")
        seq = harness.new_sequence(4)
        first = admit(request=harness.request(seq))
        assert isinstance(first, int) and not isinstance(first, bool) and 0 <= first <= 4, (
            f"kvcore_admit of 4 blocks returned {first!r}; expected an int in [0, 4]"
        )
        assert harness.write(seq) == 4, "a write stores what it is given, asked about or not"
        again = admit(request=harness.request(seq))
        assert again == 4, f"blocks already stored must count as admitted, got {again!r}"
        assert backend.admit(harness.request(seq, 0, 0)) == 0
        harness.assert_reads_back(seq, 4)


# -- helpers ---------------------------------------------------------------------------------


def _written_and_kept(h: Harness, seq: Sequence_, what: str) -> int:
    """Write ``seq``; assert a query right after finds at least what the write acknowledged
    (a write must never acknowledge blocks the store did not keep). Returns the count."""
    acked = h.write(seq)
    kept = h.query(seq)
    assert kept >= acked, (
        f"{what}: write acknowledged {int(acked)}, but a query right after counts {int(kept)}: "
        "a write must never acknowledge blocks the store did not keep"
    )
    return int(acked)
