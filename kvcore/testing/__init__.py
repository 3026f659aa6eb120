"""The conformance kit for kvcore backends (also loaded by pytest as the ``kvcore`` plugin).

Subclass :class:`BackendConformance` in a plugin's tests, or run the suite against any
installed backend with ``pytest --kvcore-backend NAME [--kvcore-config JSON_OR_PATH]``.
"""

import pytest

# The kit's asserts must explain failures in the tests of whoever runs it, also when kvcore
# is installed editable (pytest only rewrites plugin modules it can list from the dist).
pytest.register_assert_rewrite("kvcore.testing.harness", "kvcore.testing.suite")

from kvcore.testing.harness import Harness, blocks_equal, payload_for  # noqa: E402
from kvcore.testing.suite import (  # noqa: E402
    BackendConformance,
    harness_opener,
    requires,
    small_layout,
)

__all__ = [
    "BackendConformance",
    "Harness",
    "blocks_equal",
    "harness_opener",
    "payload_for",
    "requires",
    "small_layout",
]
