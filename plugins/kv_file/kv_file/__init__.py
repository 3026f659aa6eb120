"""kv_file: kvcore's embedded default backend, a crash-safe, checksummed local-disk store."""

from kv_file.backend import FileBackend
from kv_file.config import FileConfig
from kvcore.versions import installed_version

__all__ = ["FileBackend", "FileConfig", "__version__"]

__version__ = installed_version("kvcore-file")
