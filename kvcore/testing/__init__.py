"""The conformance kit for kvcore backends (also loaded by pytest as the ``kvcore`` plugin).

Subclass :class:`BackendConformance` in a plugin's tests, or run the suite against any
installed backend with ``pytest --kvcore-backend NAME [--kvcore-config JSON_OR_PATH]``.
"""

from kvcore.testing.harness import Harness, blocks_equal, payload_for
from kvcore.testing.suite import BackendConformance, requires, small_layout

__all__ = [
    "BackendConformance",
    "Harness",
    "blocks_equal",
    "payload_for",
    "requires",
    "small_layout",
]
