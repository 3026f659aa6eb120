"""The conformance kit passes the in-memory reference backend."""

from memory_backend import MemoryBackend

from kvcore.testing import BackendConformance


class TestMemoryBackend(BackendConformance):
    backend = MemoryBackend
