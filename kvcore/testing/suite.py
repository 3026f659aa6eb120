"""The backend conformance suite: subclass :class:`BackendConformance` in your plugin's tests.

::

    from kvcore.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend = "mine"                      # entry-point name (or the class itself)

        @pytest.fixture
        def backend_config(self, tmp_path):   # override what your backend needs
            return {"root": str(tmp_path)}

Tests that need an optional behaviour are marked with :func:`requires`; they are skipped,
with the reason, when the backend's ``capabilities`` declare it does not have it. Tests of
optional hooks (``kvcore_remove``, ``kvcore_clear``, ``kvcore_raw_baseline``) run when the
backend implements them. Every backend is opened in strict mode, so an exception from a hook
fails the test. Every test declares the hooks it exercises (:func:`exercises`); kvcore's own
tests check that together they cover every hook in :mod:`kvcore.hookspecs`.

The tests live in :mod:`kvcore.testing.kit`, one mixin class per capability
(:class:`~kvcore.testing.kit.RoundTripTests`, :class:`~kvcore.testing.kit.RemovalTests`...);
:class:`BackendConformance` composes them all, and this module keeps every name of the kit
importable from here.
"""

from __future__ import annotations

from kvcore.testing.kit import (
    BufferTests,
    CapacityTests,
    DeadlineTests,
    EventTests,
    EvictionTests,
    InputTests,
    LeadingRunTests,
    LifecycleTests,
    ListingTests,
    MetadataTests,
    RemovalTests,
    RoundTripTests,
    SharingTests,
    VerificationTests,
)
from kvcore.testing.kit.deadlines import deadline_layout
from kvcore.testing.kit.fixtures import (
    DeclaredCapacity,
    capacity_layout,
    harness_opener,
    small_layout,
)
from kvcore.testing.kit.marks import exercises, requires

__all__ = [
    "BackendConformance",
    "DeclaredCapacity",
    "capacity_layout",
    "deadline_layout",
    "exercised_hooks",
    "exercises",
    "harness_opener",
    "requires",
    "small_layout",
]


# pytest runs a class's inherited tests base by base from the last base listed to the first:
# listed last-run first, the kit runs round trips first and the lifecycle hooks last.
class BackendConformance(
    ListingTests,
    MetadataTests,
    LifecycleTests,
    BufferTests,
    VerificationTests,
    InputTests,
    RemovalTests,
    EvictionTests,
    EventTests,
    CapacityTests,
    DeadlineTests,
    SharingTests,
    LeadingRunTests,
    RoundTripTests,
):
    """Abstract conformance tests. Set ``backend``; override the ``backend_*`` fixtures.

    Every capability mixin of :mod:`kvcore.testing.kit`, composed."""


def exercised_hooks(cls: type | None = None) -> dict[str, list[str]]:
    """``{hook: [test names]}`` of the tests of ``cls`` (default: the kit) that exercise it."""
    cls = BackendConformance if cls is None else cls
    found: dict[str, list[str]] = {}
    for name in sorted(dir(cls)):
        if name.startswith("test_"):
            for hook in getattr(getattr(cls, name), "__kvcore_exercises__", ()):
                found.setdefault(hook, []).append(name)
    return found
