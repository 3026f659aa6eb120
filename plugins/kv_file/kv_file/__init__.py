"""kv_file: kvcore's embedded default backend, a crash-safe, checksummed local-disk store."""

from kv_file.backend import FileBackend
from kv_file.config import FileConfig

__all__ = ["FileBackend", "FileConfig"]
