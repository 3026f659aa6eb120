"""What follows a store's stream (:mod:`kvcore.events`): :class:`StoreIndex`, the objects a
store holds as a router keeps them; :class:`RankBlocks`, one rank's blocks from object events;
:class:`Announced`, what a publisher of block events told its consumers. Import them from
:mod:`kvcore.events`.

.. versionadded:: 0.3
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvcore.event_types import CLEARED, EVICTED, REMOVED, RESYNC, STORED, StoreEvent
from kvcore.keys import BlockId, ObjectName

__all__ = ["Announced", "BlockChange", "RankBlocks", "StoreIndex"]

K = TypeVar("K")
V = TypeVar("V")


class StoreIndex:
    """The objects a store holds, built from its events alone: what a router keeps.

    ``objects`` maps each name to its payload bytes. A ``cleared`` or ``resync`` event empties
    the index (after a resync, what the store still holds is unknown: forgotten, not guessed).
    """

    def __init__(self) -> None:
        self.objects: dict[str, int] = {}
        self._identities: dict[str, ObjectName] = {}  # the names kvcore built, typed
        self.last_seq = 0
        self.resyncs = 0

    def apply(self, event: StoreEvent) -> None:
        kind = event.kind
        if kind == STORED:
            self.objects.update(zip(event.names, event.sizes, strict=True))
            self._identities.update(
                (n, o) for n, o in zip(event.names, event.objects, strict=True) if o is not None
            )
        elif kind in (REMOVED, EVICTED):
            for name in event.names:
                self.objects.pop(name, None)
                self._identities.pop(name, None)
        elif kind in (CLEARED, RESYNC):
            self.objects.clear()
            self._identities.clear()
            self.resyncs += kind == RESYNC
        self.last_seq = event.seq

    def apply_all(self, events: Iterable[StoreEvent]) -> int:
        """Apply ``events`` in order; returns how many."""
        n = 0
        for event in events:
            self.apply(event)
            n += 1
        return n

    def __contains__(self, name: object) -> bool:
        return name in self.objects

    def __len__(self) -> int:
        return len(self.objects)

    def blocks(self, parts: Sequence[str] = ("k", "v")) -> set[tuple[str, str, int, int, str]]:
        """Blocks whose every part in ``parts`` is held, as ``(namespace, block key, rank,
        world size, weight version)`` (names kvcore built only)."""
        seen: dict[BlockId, set[str]] = {}
        for obj in self._identities.values():
            seen.setdefault(obj.block, set()).add(obj.part)
        want = set(parts)
        return {block for block, have in seen.items() if want <= have}


@dataclass(frozen=True, slots=True)
class BlockChange:
    """One block of one rank stored or gone, or everything gone (``kind`` is
    :data:`CLEARED`, ``block_key`` empty): what a router's block events say.

    .. versionadded:: 0.3
    """

    kind: str  # STORED, REMOVED (removed or evicted) or CLEARED (cleared, or a resync)
    block_key: str


class RankBlocks:
    """A backend's object events as one rank's block events: the one place that groups them.

    A block counts as stored once every one of ``parts`` of it is (objects of one block may
    arrive in several events), and as gone when any part of it goes. Objects of other
    namespaces, ranks and world sizes, other parts (kvcore's digests among them) and names
    kvcore did not build are not this rank's blocks and are skipped; so are objects of
    another ``weight_version`` when one is given (KV of other weights is never this engine's).
    A clear or a resync ends every block (and forgets half-stored ones). At most
    ``max_partial`` half-stored blocks are remembered, oldest forgotten first.

    .. versionadded:: 0.3
    .. versionchanged:: 0.3 ``weight_version``.
    """

    def __init__(
        self,
        namespace: str,
        parts: Iterable[str],
        rank: int,
        world_size: int,
        *,
        max_partial: int = 200_000,
        weight_version: str | None = None,
    ) -> None:
        self.namespace = namespace
        self.weight_version = weight_version
        self.parts = frozenset(parts)
        self.rank, self.world_size = rank, world_size
        self._max_partial = max_partial
        self._partial: OrderedDict[str, set[str]] = OrderedDict()

    def changes(self, event: StoreEvent) -> list[BlockChange]:
        """The block changes ``event`` makes on this rank, in order."""
        if event.kind in (CLEARED, RESYNC):
            self._partial.clear()
            return [BlockChange(CLEARED, "")]
        out: list[BlockChange] = []
        for parsed in event.objects:
            if (
                parsed is None
                or parsed.part not in self.parts
                or parsed.namespace != self.namespace
                or (parsed.rank, parsed.world_size) != (self.rank, self.world_size)
                or (
                    self.weight_version is not None and parsed.weight_version != self.weight_version
                )
            ):
                continue  # another rank's, a digest, another engine's
            key = parsed.block_key
            if event.kind == STORED:
                have = self._partial.setdefault(key, set())
                have.add(parsed.part)
                if have == self.parts:  # every part of the block: stored on this rank
                    del self._partial[key]
                    out.append(BlockChange(STORED, key))
                elif len(self._partial) > self._max_partial:
                    self._partial.popitem(last=False)
            else:
                self._partial.pop(key, None)
                out.append(BlockChange(REMOVED, key))
        return out


class Announced(Generic[K, V]):
    """What an event publisher told its consumers is stored: the one place that decides what
    it may tell of next.

    A router that hears of a block leaving that it was never told of is confused at best (a
    stricter index rejects the stream), and one told of a block twice double-counts it. So a
    publisher announces a block once (:meth:`announce` of a key not ``in`` it), tells of a
    removal only for a block it announced (:meth:`remove` answers what it was named, or None),
    and on a clear every block it announced is gone (:meth:`clear`). It remembers at most
    ``limit`` blocks: past that the oldest is withdrawn, and the publisher tells of its removal
    (a router never keeps crediting a block the publisher no longer follows).

    ``value`` is what the publisher named the block in its events (an engine's hash); never
    None. Not thread-safe: the publisher holds its own lock.

    .. versionadded:: 0.3
    """

    __slots__ = ("_items", "limit")

    def __init__(self, limit: int = 200_000) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self._items: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def announce(self, key: K, value: V) -> list[V]:
        """Record ``key`` as announced, named ``value``; returns what was withdrawn to keep
        the bound (oldest first): the publisher tells of their removal."""
        self._items[key] = value
        self._items.move_to_end(key)
        withdrawn = []
        while len(self._items) > self.limit:
            withdrawn.append(self._items.popitem(last=False)[1])
        return withdrawn

    def remove(self, key: K) -> V | None:
        """What ``key`` was announced as, forgotten now; None when it was not announced (then
        nothing is told)."""
        return self._items.pop(key, None)

    def clear(self) -> list[V]:
        """Everything announced, forgotten now (oldest first)."""
        out = list(self._items.values())
        self._items.clear()
        return out
