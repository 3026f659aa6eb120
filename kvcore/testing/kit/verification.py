"""Verification: opened as every caller opens it, a backend that keeps no checksums gets
kvcore's block digests, and a bit flipped in a stored object is never read (the read ends
before that block, which is counted and is a miss afterwards)."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.testing.harness import blocks_equal
from kvcore.testing.kit.fixtures import KitFixtures, harness_opener
from kvcore.testing.kit.marks import exercises, requires

__all__ = ["VerificationTests"]


class VerificationTests(KitFixtures):
    """Corrupt stored bytes are never handed to a caller."""

    @requires(checksums=False, addressing="key", io="host")
    @exercises("kvcore_write", "kvcore_read", "kvcore_query")
    def test_a_flipped_bit_is_never_read(
        self,
        backend_target: str | type,
        backend_config: dict[str, Any],
        backend_context: dict[str, Any],
    ) -> None:
        """Opened as every caller opens it (``verify_blocks="auto"``), a backend that keeps no
        checksums gets kvcore's block digests: a bit flipped in a stored object (through the
        backend's own hooks, as a failing store would) ends the read before that block, is
        counted, and the block is a miss afterwards (removed, where the backend can)."""
        from kvcore.testing.corruption import corrupt_reads, flip_a_stored_bit

        with harness_opener(
            backend_target, backend_config, backend_context, verify_blocks="auto"
        ) as open_:
            h = open_()
            if not h.backend.verifies_blocks:  # an instance may declare checksums (a stack)
                pytest.skip("the opened backend verifies its blocks itself")
            seq = h.new_sequence(3)
            assert h.write(seq) == 3
            name = h.request(seq).object_names[1][-1]
            flip_a_stored_bit(h.backend, name, h.layout.part_bytes(h.parts[-1]))
            done, got = h.read(seq)
            assert done == 1, f"read {int(done)} blocks past a corrupt one"
            assert blocks_equal(got[:1], h.payload(seq, 0, 1)) == []
            assert corrupt_reads(h.backend) == 1
            if h.backend.implements("kvcore_remove"):
                assert h.query(seq) == 1, "the corrupt block is still found"
