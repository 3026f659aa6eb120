"""Host memory as engines hand it over: regions announced with ``register_buffer`` (data
outlives the region, which is reused once unregistered and may be registered again), and
host buffers segmented per layer."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvcore.schemas import Capabilities
from kvcore.testing.harness import Harness, blocks_equal
from kvcore.testing.kit.fixtures import KitFixtures, small_layout
from kvcore.testing.kit.marks import DATA_HOOKS, exercises, requires

__all__ = ["BufferTests"]


class BufferTests(KitFixtures):
    """Registered and segmented host memory carries requests like any other."""

    @exercises("kvcore_register_buffer", "kvcore_unregister_buffer", "kvcore_write", "kvcore_read")
    def test_registered_regions(self, harness: Harness) -> None:
        """Regions announced with ``register_buffer`` carry requests like any memory; data
        written from one outlives it (the region is reused once unregistered), and the same
        address can be registered again (allocators hand addresses out again)."""
        h, backend = harness, harness.backend
        seq = h.new_sequence(4)
        payload = h.payload(seq, 0, 4)
        src, dst = h.region(4, payload), h.region(4)
        for region in (src, dst):
            backend.register_buffer(region.ptr, region.nbytes)
        if h.io == "host":
            assert backend.write(h.request(seq, host=src.host())) == 4
            assert backend.read(h.request(seq, host=dst.host())) == 4
            assert blocks_equal(dst.blocks(), payload) == []
            # a request may use part of a region: blocks 1-2 into the region's blocks 2-3
            middle = h.region(4)
            backend.register_buffer(middle.ptr, middle.nbytes)
            assert backend.read(h.request(seq, 1, 2, host=middle.host(2, 2))) == 2
            assert blocks_equal(middle.blocks(2, 2), payload[1:3]) == []
            backend.unregister_buffer(middle.ptr)
        else:
            assert h.write(seq) == 4
        for region in (src, dst):
            backend.unregister_buffer(region.ptr)
            region.array[:] = 0xA5  # the engine reuses the memory
        done, got = h.read(seq)
        assert done == 4
        assert blocks_equal(got, payload) == [], "stored blocks changed with the freed region"
        again = h.new_sequence(4)
        backend.register_buffer(src.ptr, src.nbytes)
        if h.io == "host":
            src.array[:] = np.frombuffer(
                b"".join(b"".join(parts) for parts in h.payload(again, 0, 4)), dtype=np.uint8
            )
            assert backend.write(h.request(again, host=src.host())) == 4
        else:
            assert h.write(again) == 4
        backend.unregister_buffer(src.ptr)
        done, got = h.read(again)
        assert done == 4 and blocks_equal(got, h.payload(again, 0, 4)) == []

    @requires(io="host", segmented_host=True)
    @exercises(*DATA_HOOKS)
    def test_segmented_host_buffers_round_trip(
        self, open_harness: Callable[..., Harness], capabilities: Capabilities
    ) -> None:
        """Objects split into one segment per layer (an engine's host-resident cache) store
        the same bytes as contiguous staging regions, in both directions."""
        dtype = "block_wise_fp8" if capabilities.scales else "bfloat16"
        h = open_harness(small_layout(dtype))
        seq = h.new_sequence(4)
        payload = h.payload(seq, 0, 4)
        source, _ = h.segmented(4, payload)
        assert h.backend.write(h.request(seq, host=source)) == 4
        assert h.query(seq) == 4
        done, got = h.read(seq)  # contiguous
        assert done == 4
        assert blocks_equal(got, payload) == [], "segmented write stored other bytes"
        target, extract = h.segmented(4)
        assert h.backend.read(h.request(seq, host=target)) == 4
        assert blocks_equal(extract(), payload) == [], "segmented read returned other bytes"
        other = h.new_sequence(2)
        assert h.write(other) == 2  # contiguous
        target, extract = h.segmented(2)
        assert h.backend.read(h.request(other, host=target)) == 2
        assert blocks_equal(extract(), h.payload(other, 0, 2)) == []
