"""What a store gains and loses, as events: a stream per opened backend, and what follows one.

Routers place a request on the replica whose tiers already hold its prefix (llm-d's KV-cache
indexer, NVIDIA Dynamo's KV router); they learn what is where from events. Every opened
:class:`kvcore.Backend` has an :class:`EventStream` (``backend.events``):

- ``stored``: objects a write acknowledged (names, payload sizes);
- ``removed``: objects ``remove`` deleted (every name of the removed blocks);
- ``evicted``: objects the backend dropped on its own (capacity), as it reports them through
  the ``kvcore_watch`` hook;
- ``cleared``: every object of the namespace is gone;
- ``resync``: this subscriber fell behind and events were dropped: forget everything the
  stream said before (as vLLM's ``AllBlocksCleared``); never a silent gap.

A publisher that attaches to a store others filled announces what it holds already: a
subscription taken with ``listing=True`` first yields the store's listing (taken after
subscribing, so no change is missed between them) as ``stored`` events of origin ``listed``
(sequence number 0), then the changes since; after a ``resync`` it lists again, so what it
announces is never left short. The one place every engine adapter's announcer gets it from.

kvcore reports what it sees through the facade (writes, removes, clears); a backend reports
what only it can see (``kvcore_watch``: its evictions, and for a store that several processes
share, the others' changes, ``origin="peer"``). A store shared by processes: kv_file reports
every change in the directory, whoever made it, in one order, so one process's stream
describes the whole store.

Every event carries a sequence number, increasing by one per event on its stream, the
namespace, the weight version of its names and each name's part. A subscriber's queue is
bounded (in objects): when it is full, its queue is replaced by one ``resync`` event. With no
subscriber nothing is built: publishing is one attribute read.

:class:`StoreIndex` is the reference consumer: the objects a store holds, built from events
alone, as a router would. :class:`RankBlocks` groups a stream's objects into one rank's blocks,
and :class:`Announced` keeps what a publisher of block events told its consumers (each block
announced once, removals only of announced blocks), for every engine adapter.

.. versionadded:: 0.3
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from kvcore.event_index import Announced, BlockChange, RankBlocks, StoreIndex
from kvcore.event_types import (
    CLEARED,
    EVICTED,
    KINDS,
    LISTED,
    LOCAL,
    OBJECT_KINDS,
    PEER,
    REMOVED,
    RESYNC,
    STORED,
    StoreEvent,
)
from kvcore.keys import ObjectName

__all__ = [
    "CLEARED",
    "EVICTED",
    "KINDS",
    "LISTED",
    "LISTING_BATCH",
    "LOCAL",
    "PEER",
    "REMOVED",
    "RESYNC",
    "STORED",
    "Announced",
    "BlockChange",
    "EventStream",
    "RankBlocks",
    "StoreEvent",
    "StoreIndex",
    "Subscription",
]

#: objects a subscriber's queue holds by default before it falls back to one ``resync``
DEFAULT_QUEUE_OBJECTS = 1 << 20
#: names in each ``listed`` event of a subscription's listing
LISTING_BATCH = 4096

#: what a stream lists the store with: every object's name and identity (None where kvcore
#: did not build the name), the store's content only (no digest kvcore keeps beside blocks)
Lister = Callable[[], tuple[Sequence[str], Sequence["ObjectName | None"]]]


class Subscription:
    """One consumer's bounded queue of a stream's events. Thread-safe.

    Take events with :meth:`get` (one, waiting up to ``timeout``), :meth:`drain` (all queued)
    or by iterating (until :meth:`close` or the stream closes). ``resyncs`` counts how often
    the queue overflowed. With a ``lister`` (``EventStream.subscribe(listing=True)``), the
    first take lists the store, in the taker's thread: its ``listed`` events come first (after
    a ``resync`` the store is listed again and its events follow the ``resync``); ``listed``
    counts the objects announced so.

    .. versionchanged:: 0.3 ``listing``; :meth:`drain` takes ``max_objects``.
    """

    def __init__(
        self,
        stream: EventStream,
        max_objects: int,
        lister: Lister | None = None,
        listing_batch: int = LISTING_BATCH,
    ) -> None:
        if max_objects < 1:
            raise ValueError(f"max_objects must be >= 1, got {max_objects}")
        if listing_batch < 1:
            raise ValueError(f"listing_batch must be >= 1, got {listing_batch}")
        self._stream = stream
        self.max_objects = max_objects
        self._queue: deque[StoreEvent] = deque()
        self._objects = 0
        self._ready = threading.Condition(threading.Lock())
        self._lister = lister
        self._listing_batch = listing_batch
        self._listing_due = lister is not None
        #: the store's listing, still to take: before every queued event (but a resync)
        self._listed: deque[StoreEvent] = deque()
        self.listed = 0
        self.resyncs = 0
        self.closed = False

    @property
    def listing_pending(self) -> bool:
        """Whether some of the store's listing is still to be taken (or to be made): False
        once a consumer has been told everything the store held (and always without one)."""
        with self._ready:
            return self._listing_due or bool(self._listed)

    def _offer(self, event: StoreEvent) -> None:
        """Queue ``event`` (called by the stream, in sequence order)."""
        weight = max(1, len(event.names))
        with self._ready:
            if self.closed:
                return
            if self._objects + weight > self.max_objects:
                # fell behind: everything queued is replaced by one resync, then the news if
                # it fits (the resync takes the number of the last event it stands for, so a
                # subscriber's numbers keep increasing); a listing subscriber lists again
                keep = 1 + weight <= self.max_objects
                seq = event.seq - 1 if keep else event.seq
                self._queue.clear()
                self._queue.append(StoreEvent(seq, RESYNC, event.namespace, time=event.time))
                self._objects = 1
                self.resyncs += 1
                if self._lister is not None:
                    self._listed.clear()
                    self._listing_due = True
                if not keep:
                    self._ready.notify_all()
                    return
            self._queue.append(event)
            self._objects += weight
            self._ready.notify_all()

    def _list(self) -> None:
        """List the store if due (outside the lock: a listing may take a while), its events
        put before what was queued since subscribing (or since the resync)."""
        lister = self._lister
        if lister is None:
            return
        with self._ready:
            due, self._listing_due = self._listing_due, False
        if not due:
            return
        names, objects = lister()
        namespace, now, step = self._stream.namespace, time.time(), self._listing_batch
        listed = [
            StoreEvent(
                0,
                STORED,
                namespace,
                tuple(names[lo : lo + step]),
                (0,) * len(names[lo : lo + step]),
                tuple("" if o is None else o.part for o in objects[lo : lo + step]),
                origin=LISTED,
                time=now,
                objects=tuple(objects[lo : lo + step]),
            )
            for lo in range(0, len(names), step)
        ]
        with self._ready:
            if self._listing_due:  # a resync meanwhile: this listing may be stale, list again
                return
            self._listed.extend(listed)
            self.listed += len(names)
            self._ready.notify_all()

    def _take(self) -> StoreEvent | None:
        """The next event, under the lock: a resync, then the listing, then the queue."""
        queue = self._queue
        if queue and (queue[0].kind == RESYNC or not self._listed):
            event = queue.popleft()
            self._objects -= max(1, len(event.names))
            return event
        if self._listed:
            return self._listed.popleft()
        return None

    def get(self, timeout: float | None = None) -> StoreEvent | None:
        """The next event, waiting up to ``timeout`` seconds (None: until one comes or the
        subscription closes); None when none came."""
        self._list()
        with self._ready:
            if not self._queue and not self._listed and not self.closed:
                self._ready.wait_for(lambda: self._queue or self._listed or self.closed, timeout)
            return self._take()

    def drain(self, max_objects: int | None = None) -> list[StoreEvent]:
        """The queued events, oldest first (without waiting): all of them, or as many as hold
        at most ``max_objects`` objects (at least one event: a consumer announcing a large
        listing over several steps)."""
        self._list()
        events: list[StoreEvent] = []
        taken = 0
        with self._ready:
            while True:
                head = self._queue[0] if self._queue else None
                if head is None or (head.kind != RESYNC and self._listed):
                    head = self._listed[0] if self._listed else head
                if head is None:
                    break
                weight = max(1, len(head.names))
                if events and max_objects is not None and taken + weight > max_objects:
                    break
                event = self._take()
                assert event is head
                events.append(event)
                taken += weight
        return events

    def __iter__(self) -> Iterator[StoreEvent]:
        while True:
            event = self.get()
            if event is None:
                return
            yield event

    def close(self) -> None:
        """Stop receiving; a waiting :meth:`get` returns. The last subscription to close
        stops the backend's own reporting."""
        with self._ready:
            if self.closed:
                return
            self.closed = True
            self._ready.notify_all()
        self._stream._unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventStream:
    """The events of one opened backend (see the module docstring).

    ``on_watch(True)`` is called when the first subscriber arrives and ``on_watch(False)`` when
    the last one leaves: the facade starts and stops the backend's own reporting there.
    """

    def __init__(
        self,
        namespace: str,
        on_watch: Callable[[bool], None] | None = None,
        lister: Lister | None = None,
    ) -> None:
        self.namespace = namespace
        self._on_watch = on_watch
        self._lister = lister
        self._lock = threading.Lock()
        self._subs: tuple[Subscription, ...] = ()
        self._seq = 0
        self._closed = False

    @property
    def active(self) -> bool:
        """Whether anyone listens (publishers check this before building an event)."""
        return bool(self._subs)

    def subscribe(
        self,
        max_objects: int = DEFAULT_QUEUE_OBJECTS,
        *,
        listing: bool = False,
        listing_batch: int = LISTING_BATCH,
    ) -> Subscription:
        """A new subscription, receiving every event published from now on.

        :param max_objects: objects its queue holds before it falls back to one ``resync``.
        :param listing: first, what the store holds already: listed at the first take (after
            subscribing: nothing changed between them is missed), as ``stored`` events of
            origin :data:`LISTED`, ``listing_batch`` names each; listed again after a resync.
            A stream that cannot list (a backend without ``kvcore_names``) lists nothing.

        .. versionchanged:: 0.3 ``listing``, ``listing_batch``.
        """
        lister = self._lister if listing else None
        sub = Subscription(self, max_objects, lister, listing_batch)
        with self._lock:
            if self._closed:
                raise RuntimeError("the event stream is closed (its backend was closed)")
            first = not self._subs
            self._subs = (*self._subs, sub)
        if first and self._on_watch is not None:
            self._on_watch(True)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub not in self._subs:
                return
            self._subs = tuple(s for s in self._subs if s is not sub)
            last = not self._subs
        if last and self._on_watch is not None:
            self._on_watch(False)

    def publish(
        self,
        kind: str,
        names: Sequence[str] = (),
        sizes: Sequence[int] | None = None,
        *,
        origin: str = LOCAL,
        objects: Sequence[ObjectName | None] | None = None,
        tenant: str | None = None,
    ) -> None:
        """Give every subscriber one event per weight version among ``names``.

        :param sizes: each object's payload bytes (None: unknown, 0 each).
        :param objects: each name's identity where the publisher has it (a request's
            :class:`kvcore.keys.NameRows`); None: the names are read once, here.
        :param tenant: whose objects they are, where known (:attr:`StoreEvent.tenant`).

        .. versionchanged:: 0.3 ``objects``, ``tenant``.
        """
        if not self._subs:
            return
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {list(KINDS)}")
        if kind in OBJECT_KINDS and not names:
            return
        names = tuple(names)
        if sizes is None:
            sizes = (0,) * len(names)
        elif len(sizes) != len(names):
            raise ValueError(f"{len(sizes)} sizes for {len(names)} names")
        if objects is None:
            objects = [ObjectName.parse(name) for name in names]
        elif len(objects) != len(names):
            raise ValueError(f"{len(objects)} identities for {len(names)} names")
        now = time.time()
        with self._lock:  # one order for every subscriber
            for version, group in _by_weight_version(names, sizes, objects):
                self._seq += 1
                event = StoreEvent(
                    seq=self._seq,
                    kind=kind,
                    namespace=self.namespace,
                    names=tuple(n for n, _, _ in group),
                    sizes=tuple(int(s) for _, s, _ in group),
                    parts=tuple("" if o is None else o.part for _, _, o in group),
                    weight_version=version,
                    origin=origin,
                    time=now,
                    objects=tuple(o for _, _, o in group),
                    tenant=tenant,
                )
                for sub in self._subs:
                    sub._offer(event)

    def close(self) -> None:
        """Close every subscription (their iterators end); no subscriber can join after."""
        with self._lock:
            self._closed = True
            subs = self._subs
        for sub in subs:
            sub.close()


_Named = tuple[str, int, "ObjectName | None"]


def _by_weight_version(
    names: tuple[str, ...], sizes: Sequence[int], objects: Sequence[ObjectName | None]
) -> list[tuple[str, list[_Named]]]:
    """``(weight version, [(name, size, identity), ...])`` groups, in the names' order."""
    if not names:
        return [("", [])]
    groups: dict[str, list[_Named]] = {}
    for name, size, obj in zip(names, sizes, objects, strict=True):
        version = "" if obj is None else obj.weight_version
        groups.setdefault(version, []).append((name, size, obj))
    return list(groups.items())
