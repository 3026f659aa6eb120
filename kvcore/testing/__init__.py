"""The conformance kit for kvcore backends.

Subclass :class:`BackendConformance` in a plugin's tests, or run the suite against any
installed backend with ``pytest --kvcore-backend NAME [--kvcore-config JSON_OR_PATH]`` (kvcore's
pytest plugin imports this package only then: :mod:`kvcore.testing.plugin`).
"""

import pytest

# The kit's asserts must explain failures in the tests of whoever runs it, also when kvcore
# is installed editable (pytest only rewrites plugin modules it can list from the dist).
pytest.register_assert_rewrite(
    "kvcore.testing.harness",
    "kvcore.testing.kit",  # the kit's tests, one module per capability (and its submodules)
    "kvcore.testing.suite",
    "kvcore.testing.identity",
)

from kvcore.testing.harness import (  # noqa: E402
    Harness,
    HostRegion,
    Sequence_,
    blocks_equal,
    payload_for,
)
from kvcore.testing.suite import (  # noqa: E402
    BackendConformance,
    DeclaredCapacity,
    capacity_layout,
    deadline_layout,
    exercised_hooks,
    exercises,
    harness_opener,
    requires,
    small_layout,
)

__all__ = [
    "BackendConformance",
    "DeclaredCapacity",
    "Harness",
    "HostRegion",
    "Sequence_",
    "blocks_equal",
    "capacity_layout",
    "deadline_layout",
    "exercised_hooks",
    "exercises",
    "harness_opener",
    "payload_for",
    "requires",
    "small_layout",
]
