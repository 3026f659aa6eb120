"""Today's kit on a backend written against 0.1, unchanged (see backend_written_for_0_1.py)."""

from backend_written_for_0_1 import DictBackend

from kvcore.testing import BackendConformance


class TestBackendWrittenFor01(BackendConformance):
    backend = DictBackend
