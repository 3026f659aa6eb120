"""The conformance kit passes the in-memory reference backend."""

import pytest
from memory_backend import MemoryBackend

from kvcore.testing import BackendConformance, DeclaredCapacity, capacity_layout


class TestMemoryBackend(BackendConformance):
    backend = MemoryBackend

    @pytest.fixture
    def backend_capacity(self) -> DeclaredCapacity:
        # max_objects bounds the store: 64 objects of the capacity test's layout
        return DeclaredCapacity({"max_objects": 64}, 64 * capacity_layout().part_bytes("k"))
