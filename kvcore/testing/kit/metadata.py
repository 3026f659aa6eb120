"""Blocks that describe themselves: the metadata a writer gives each block
(``BlockRequest.block_meta``) comes back from ``kvcore_describe``, from any instance of a
shared store, and never for a block it was not written with."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvcore.requests import MAX_BLOCK_META_BYTES
from kvcore.schemas import Capabilities
from kvcore.testing.harness import Harness
from kvcore.testing.kit.fixtures import KitFixtures
from kvcore.testing.kit.marks import exercises, requires

__all__ = ["ListingTests", "MetadataTests"]


def _meta(i: int, size: int = 96) -> bytes:
    """Distinct metadata per block, of ``size`` bytes (every byte value appears)."""
    return bytes((i * 131 + k) % 256 for k in range(size))


class MetadataTests(KitFixtures):
    """``kvcore_describe`` (backends with ``Capabilities(block_meta=True)``)."""

    @requires(block_meta=True)
    @exercises("kvcore_describe", "kvcore_write")
    def test_each_block_describes_itself_as_written(self, harness: Harness) -> None:
        """Each block's metadata back as written, byte for byte; a block never stored, or
        stored without metadata, has none; the payload reads back unchanged."""
        seq = harness.new_sequence(5)
        metas = [_meta(i) for i in range(3)]
        metas[2] = _meta(2, MAX_BLOCK_META_BYTES)  # the largest a block may carry
        assert harness.write(seq, 0, 3, block_meta=metas) == 3
        assert harness.write(seq, 3, 1) == 1  # no metadata
        described = harness.backend.describe(harness.request(seq))
        assert described == [*metas, None, None], (
            "describe must return each block's metadata as written, None for a block "
            f"stored without it (block 3) or never stored (block 4); got {described!r}"
        )
        harness.assert_reads_back(seq, 4)
        empty = harness.backend.describe(harness.request(harness.new_sequence(2)))
        assert empty == [None, None]

    @requires(block_meta=True, shared=True)
    @exercises("kvcore_describe")
    def test_another_instance_reads_what_a_block_says(
        self, open_harness: Callable[..., Harness], capabilities: Capabilities
    ) -> None:
        """What one instance wrote is described to another opened on the same store (another
        engine), which never wrote the block."""
        writer, reader = open_harness(), open_harness()
        seq = writer.new_sequence(3)
        metas = [_meta(i + 7) for i in range(3)]
        assert writer.write(seq, block_meta=metas) == 3
        assert reader.backend.describe(reader.request(seq)) == metas


class ListingTests(KitFixtures):
    """``kvcore_names``: what a store holds, listed."""

    @exercises("kvcore_names", "kvcore_write", "kvcore_remove")
    def test_the_listing_holds_every_stored_object(
        self, harness: Harness, capabilities: Capabilities
    ) -> None:
        """Every object written is listed, under the names its requests give it; a removed
        block's objects are not."""
        if not harness.backend.implements("kvcore_names"):
            pytest.skip("the backend does not list its objects (kvcore_names)")
        seq = harness.new_sequence(3)
        assert harness.write(seq) == 3
        names = set(harness.backend.names())
        rows = harness.request(seq).object_names
        missing = [name for row in rows for name in row if name not in names]
        assert not missing, f"stored objects missing from the listing: {missing[:3]}"
        if harness.backend.implements("kvcore_remove"):
            assert harness.backend.remove(harness.request(seq, 2, 1)) == 1
            left = set(harness.backend.names())
            assert not set(rows[2]) & left, "a removed block's objects are still listed"
            assert set(rows[0]) <= left
