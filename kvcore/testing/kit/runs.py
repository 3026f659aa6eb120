"""Leading-run semantics: a query or read counts the blocks stored from the request's start
up to the first one that is not (a gap, a block missing a part, a trailing partial block, an
object of another size than asked for); absence is a clean short count, never a failure."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvcore.errors import ConfigError
from kvcore.requests import BlockRequest, HostBuffers
from kvcore.testing.harness import Harness, blocks_equal
from kvcore.testing.kit.fixtures import KitFixtures, _open_without_layout, small_layout
from kvcore.testing.kit.marks import DATA_HOOKS, exercises, requires

__all__ = ["LeadingRunTests"]


class LeadingRunTests(KitFixtures):
    """Counts are leading runs of whole stored blocks; what is missing is a plain miss."""

    # -- leading-run semantics -------------------------------------------------------------

    @exercises(*DATA_HOOKS)
    def test_object_names_as_plain_rows(self, harness: Harness) -> None:
        """``BlockRequest.object_names`` is typed as rows of names. Code other than
        ``Backend.request`` (an engine adapter, a 0.1 caller) builds it as plain tuples, and a
        backend must take those as it takes the names kvcore builds."""
        seq = harness.new_sequence(3)
        assert harness.write(seq, 0, 2) == 2
        assert harness.backend.query(_plain_rows(harness.request(seq))) == 2
        request, extract = harness.read_request(seq)
        assert harness.backend.read(_plain_rows(request)) == 2
        assert blocks_equal(extract()[:2], harness.payload(seq, 0, 2)) == []
        assert harness.backend.write(_plain_rows(harness.write_request(seq, 2, 1))) == 1
        harness.assert_reads_back(seq, 3)

    @exercises("kvcore_query", "kvcore_read")
    def test_missing_keys_query_zero_and_read_zero(self, harness: Harness) -> None:
        seq = harness.new_sequence(3)
        assert harness.query(seq) == 0
        assert harness.read(seq)[0] == 0

    @exercises(*DATA_HOOKS)
    def test_absence_is_not_a_failure(self, harness: Harness) -> None:
        """``Outcome.failure`` is for failures: a block that is simply not stored is a clean
        miss, or the engine would count every cold prefix as a backend error."""

        def plain_count(what: str, got: int, want: int) -> None:
            assert got == want, f"{what}: {int(got)} blocks, expected {want}"
            failure = getattr(got, "failure", None)
            assert failure is None, (
                f"{what} reported failure {failure!r}: absence must be a plain short count"
            )

        seq = harness.new_sequence(3)
        plain_count("query of unwritten blocks", harness.query(seq), 0)
        plain_count("read of unwritten blocks", harness.read(seq)[0], 0)
        plain_count("write of two blocks", harness.write(seq, 0, 2), 2)
        plain_count("query past the stored blocks", harness.query(seq), 2)
        plain_count("read past the stored blocks", harness.read(seq)[0], 2)

    @exercises(*DATA_HOOKS)
    def test_gap_ends_the_run(self, harness: Harness) -> None:
        seq = harness.new_sequence(5)
        assert harness.write(seq, 0, 2) == 2
        assert harness.write(seq, 3, 2) in (0, 1, 2)  # may be refused without block 2
        assert harness.query(seq) == 2
        harness.assert_reads_back(seq, 2)

    @requires(addressing="key")
    @exercises("kvcore_contains", "kvcore_write", "kvcore_query")
    def test_contains_answers_each_block_past_every_gap(self, harness: Harness) -> None:
        """``Backend.contains`` (the backend's ``kvcore_contains``, or kvcore's queries per
        gap without it): each block on its own, as a query from that block would count it."""
        seq = harness.new_sequence(7)
        assert harness.write(seq, 0, 2) == 2
        assert harness.write(seq, 3, 2) == 2
        assert harness.write(seq, 6, 1) == 1
        presence = harness.backend.contains(harness.request(seq))
        assert presence.failure is None, f"contains reported failure {presence.failure!r}"
        assert presence.found == (True, True, False, True, True, False, True)
        assert harness.query(seq) == 2  # the leading run is unchanged
        for start in range(7):  # each block as a query from it counts it
            assert (harness.query(seq, start) > 0) == presence.found[start]
        never = harness.backend.contains(harness.request(harness.new_sequence(3)))
        assert (never.found, never.failure) == ((False,) * 3, None)

    @exercises(*DATA_HOOKS)
    def test_run_stops_where_stored_blocks_end(self, harness: Harness) -> None:
        seq = harness.new_sequence(6)
        assert harness.write(seq, 0, 4) == 4
        assert harness.query(seq) == 4
        assert harness.read(seq)[0] == 4

    @exercises(*DATA_HOOKS)
    def test_start_index(self, harness: Harness) -> None:
        seq = harness.new_sequence(6)
        assert harness.write(seq, 0, 3) == 3
        assert harness.write(seq, 3, 3) == 3
        assert harness.query(seq) == 6
        assert harness.query(seq, 2) == 4
        done, got = harness.read(seq, 2, 3)
        assert done == 3
        assert blocks_equal(got, harness.payload(seq, 2, 3)) == []

    @requires(addressing="token")
    @exercises("kvcore_write", "kvcore_query")
    def test_trailing_partial_block_is_not_counted(self, harness: Harness) -> None:
        seq = harness.new_sequence(3, extra_tokens=harness.layout.block_size // 2)
        assert harness.write(seq) == 3
        assert harness.query(seq) == 3

    @requires(addressing="key", io="host")
    @exercises(*DATA_HOOKS)
    def test_block_missing_a_part_does_not_count(self, harness: Harness) -> None:
        seq = harness.new_sequence(3)
        assert harness.write(seq, 0, 2) == 2
        # store block 2's K only, by writing under a request that names just that part
        full = harness.request(seq, 2, 1)
        payload = harness.payload(seq, 2, 1)
        host = harness._buffers_holding(payload)["host"]
        k_only = BlockRequest(
            task_id=full.task_id,
            block_keys=full.block_keys,
            object_names=((full.object_names[0][0],),),
            parts=("k",),
            deadline=full.deadline,
            start_block=2,
            token_ids=full.token_ids,
            host=HostBuffers(ptrs=((host.ptrs[0][0],),), nbytes=(host.nbytes[0],)),
        )
        assert harness.backend.write(k_only) == 1
        assert harness.query(seq) == 2
        assert harness.read(seq)[0] == 2

    @requires(io="host")
    @exercises("kvcore_write", "kvcore_read")
    def test_size_mismatch_is_a_miss(
        self,
        backend_target: str | type,
        backend_config: dict[str, Any],
        backend_context: dict[str, Any],
    ) -> None:
        """A stored object whose size differs from the region asked for is a miss, never a
        partial copy. With a layout, kvcore sizes every region itself; without one (a backend
        opened for tools, or an engine that shares a store with another layout) any size
        reaches the backend, so that is where the kit asks."""
        try:
            backend = _open_without_layout(backend_target, backend_config, backend_context)
        except ConfigError as exc:
            pytest.skip(f"backend needs a layout to open: {exc}")
        harness = Harness(backend, small_layout())
        try:
            seq = harness.new_sequence(2)
            assert harness.write(seq) == 2
            request, _ = harness.read_request(seq)
            host = request.host
            assert host is not None, "a host-I/O backend's read request has host buffers"
            shrunk = HostBuffers(ptrs=host.ptrs, nbytes=tuple(n - 8 for n in host.nbytes))
            got = backend.read(replace(request, host=shrunk))
            assert got == 0, f"a read into regions 8 bytes short of the stored objects gave {got!r}"
            done, data = harness.read(seq)
            assert done == 2 and blocks_equal(data, harness.payload(seq, 0, 2)) == []
        finally:
            backend.close()
            harness.release()


# -- helpers ---------------------------------------------------------------------------------


def _plain_rows(request: BlockRequest) -> BlockRequest:
    """The request with its object names as a tuple of tuples."""
    return replace(request, object_names=tuple(tuple(row) for row in request.object_names))
