"""The conformance kit's tests, one mixin class per capability (as fsspec's abstract test
suites are mixins): :class:`kvcore.testing.BackendConformance` composes them all.

Each mixin derives from :class:`KitFixtures` (the ``backend`` attribute, the ``backend_*``
fixtures a plugin overrides and the fixtures the kit provides), so a backend's tests may also
compose only some capabilities::

    from kvcore.testing.kit import RemovalTests, RoundTripTests

    class TestMyBackendData(RoundTripTests, RemovalTests):
        backend = "mine"

The mixins, in the order the kit runs them:

- :class:`RoundTripTests`: byte-exact round trips, idempotent writes, rewrites, reopen
- :class:`LeadingRunTests`: counts are leading runs; absence is a plain miss
- :class:`SharingTests`: ranks, namespaces, instances and threads sharing a store
- :class:`DeadlineTests`: expired deadlines and deadlines passing mid-batch
- :class:`CapacityTests`: batches over the declared capacity; ``kvcore_admit``
- :class:`EventTests`: the event stream (``kvcore_watch``)
- :class:`EvictionTests`: the hand-over of evictions (``kvcore_evict_to``)
- :class:`RemovalTests`: ``kvcore_remove`` and ``kvcore_clear``
- :class:`InputTests`: hostile keys, bad config, opening without a layout
- :class:`VerificationTests`: kvcore's block digests catch a flipped bit
- :class:`BufferTests`: registered regions and segmented host buffers
- :class:`LifecycleTests`: token-index flush, stats, raw baseline, close
- :class:`MetadataTests`: blocks that describe themselves (``kvcore_describe``)
- :class:`ListingTests`: what a store holds, listed (``kvcore_names``)
"""

from kvcore.testing.kit.buffers import BufferTests
from kvcore.testing.kit.capacity import CapacityTests
from kvcore.testing.kit.data import RoundTripTests
from kvcore.testing.kit.deadlines import DeadlineTests
from kvcore.testing.kit.events import EventTests
from kvcore.testing.kit.evictions import EvictionTests
from kvcore.testing.kit.fixtures import KitFixtures
from kvcore.testing.kit.inputs import InputTests
from kvcore.testing.kit.lifecycle import LifecycleTests
from kvcore.testing.kit.metadata import ListingTests, MetadataTests
from kvcore.testing.kit.removal import RemovalTests
from kvcore.testing.kit.runs import LeadingRunTests
from kvcore.testing.kit.sharing import SharingTests
from kvcore.testing.kit.verification import VerificationTests

__all__ = [
    "BufferTests",
    "CapacityTests",
    "DeadlineTests",
    "EventTests",
    "EvictionTests",
    "InputTests",
    "KitFixtures",
    "LeadingRunTests",
    "LifecycleTests",
    "ListingTests",
    "MetadataTests",
    "RemovalTests",
    "RoundTripTests",
    "SharingTests",
    "VerificationTests",
]
