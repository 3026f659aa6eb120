"""The events of a store's stream (:mod:`kvcore.events`): their kinds, origins and
:class:`StoreEvent`, in a module of their own so the stream and what follows one
(:mod:`kvcore.event_index`) both build on them. Import them from :mod:`kvcore.events`.

.. versionadded:: 0.3
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvcore.keys import ObjectName

__all__ = [
    "CLEARED",
    "EVICTED",
    "KINDS",
    "LISTED",
    "LOCAL",
    "OBJECT_KINDS",
    "PEER",
    "REMOVED",
    "RESYNC",
    "STORED",
    "StoreEvent",
]

STORED = "stored"
REMOVED = "removed"
EVICTED = "evicted"
CLEARED = "cleared"
RESYNC = "resync"
KINDS = (STORED, REMOVED, EVICTED, CLEARED, RESYNC)
#: the kinds whose events name objects
OBJECT_KINDS = frozenset((STORED, REMOVED, EVICTED))

#: this opened backend made the change (its write, remove, clear or eviction)
LOCAL = "local"
#: another process or client sharing the store made it, as the backend observed
PEER = "peer"
#: not a change: the store held the object when the subscriber attached (or resynced), as its
#: listing said (``subscribe(listing=True)``)
LISTED = "listed"


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """One change of a store.

    :param seq: the stream's sequence number: one more than the event before it on the stream
        (a subscriber sees increasing numbers; a ``resync`` marks where it lost events).
    :param kind: ``stored``, ``removed``, ``evicted``, ``cleared`` or ``resync``.
    :param namespace: the opened backend's namespace.
    :param names: the objects' names (none for ``cleared`` and ``resync``).
    :param sizes: each object's payload bytes (0 where unknown).
    :param parts: each object's part (``k``, ``v``, ``sum``, ...; ``""`` for names kvcore did
        not build, such as an engine's own).
    :param weight_version: the weight version the names carry (``""`` for none).
    :param origin: ``local`` (this opened backend), ``peer`` (another process sharing it), or
        ``listed`` (a subscription's listing of what the store held: not a change).
    :param time: wall-clock seconds when the event was published.
    :param objects: each name's identity (:class:`kvcore.keys.ObjectName`; None for names
        kvcore did not build), so a consumer never reads fields back from a name.
    :param tenant: the tenant whose objects they are (:mod:`kvcore.tenants`: the tenant the
        write that stored them named), where the publisher knows it; None otherwise.

    .. versionchanged:: 0.3 ``objects``, ``tenant``.
    """

    seq: int
    kind: str
    namespace: str
    names: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    parts: tuple[str, ...] = ()
    weight_version: str = ""
    origin: str = LOCAL
    time: float = 0.0
    objects: tuple[ObjectName | None, ...] = ()
    tenant: str | None = None

    def __post_init__(self) -> None:
        if len(self.objects) != len(self.names):
            if self.objects:
                raise ValueError(f"{len(self.objects)} identities for {len(self.names)} names")
            # an event built by hand (0.3 code): its names are read once, here
            object.__setattr__(self, "objects", tuple(ObjectName.parse(n) for n in self.names))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``kvcore events`` prints one per line; the names stand for
        their identities)."""
        out = asdict(self)
        del out["objects"]
        for field in ("names", "sizes", "parts"):
            out[field] = list(out[field])
        return out
