"""Tenants' shares of one store: the rule of :mod:`kvcore.tenants`, over the index's objects.

The index (:mod:`kv_file.index`) keeps every object in one least-recently-used order, the
same in every process (the journal orders every change). With shares configured, this keeps
each tenant's objects in their own order too, in the same relative order (every add and touch
gives an object the next tick), and plans an admission by the shares:

- a write past its tenant's quota evicts the tenant's own least recently used objects;
- a write past the high watermark evicts, down to the low one, the least recently used object
  among the tenants holding more than their reserved share; where none does, the writer's
  own; where it has none, what is left of the write is refused, and nothing is evicted for
  the objects refused (writes in flight can hold more than the store can free).

A tenant's bytes are its stored objects' (what the journal says each tenant's writes stored)
plus what the planned write adds; writes in flight in other processes count against the
store's capacity, not against their tenant's share (a quota may be passed by what another
process of the same tenant has in flight, and the tenant's next write takes it back).

Not thread-safe: the index calls it under its lock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Iterator

from kvcore.tenants import TenantSettings

__all__ = ["Shares"]

#: a victim unit: a block's objects (its parts go together) and the tick of the one chosen
Unit = tuple[int, list[int]]


class Shares:
    """Each tenant's objects in LRU order, and admissions planned by the shares."""

    def __init__(self, settings: TenantSettings) -> None:
        self.settings = settings
        self.reserved = {t: int(s.reserved_bytes) for t, s in settings.tenants.items()}
        self.quota = {
            t: int(s.quota_bytes) for t, s in settings.tenants.items() if s.quota_bytes is not None
        }
        self.orders: dict[str, OrderedDict[int, int]] = {}  # tenant -> digest -> tick

    # -- the orders (the index calls these as its own order changes) ---------------------------

    def add(self, tenant: str, digest: int, tick: int) -> None:
        self.orders.setdefault(tenant, OrderedDict())[digest] = tick

    def touch(self, tenant: str, digest: int, tick: int) -> None:
        order = self.orders.get(tenant)
        if order is not None and digest in order:
            order[digest] = tick
            order.move_to_end(digest)

    def drop(self, tenant: str, digest: int) -> None:
        order = self.orders.get(tenant)
        if order is not None:
            order.pop(digest, None)
            if not order:
                del self.orders[tenant]

    def clear(self) -> None:
        self.orders.clear()

    # -- planning ------------------------------------------------------------------------------

    def plan(
        self,
        writer: str,
        sizes: list[int],
        projected: int,
        limits: tuple[int, int, int],
        held: Counter[str],
        unit_of: Callable[[int], tuple[list[int], bool]],
        size_and_tenant: Callable[[int], tuple[int, str]],
        leaving: Container[int],
    ) -> tuple[list[int], int]:
        """:meth:`kv_file.index.Index.plan_admission` by the shares: ``(victims, admitted)``
        for a write of ``sizes`` (in order) by ``writer``, with ``projected`` bytes counted
        against the capacity already. ``limits``: the capacity, high and low watermarks in
        bytes; ``held``: each tenant's bytes stored; ``unit_of(digest)``: the objects evicted
        with it and whether one of them is pinned; ``size_and_tenant(digest)``: its entry's.
        Nothing changes here."""
        capacity, high, low = limits
        quota = self.quota.get(writer)
        total = sum(sizes)
        if projected + total <= high and (quota is None or held[writer] + total <= quota):
            return [], len(sizes)
        delta: Counter[str] = Counter()  # each tenant's bytes the plan adds or evicts
        chosen: set[int] = set()
        heads: dict[str, Unit | None] = {}
        cursors: dict[str, Iterator[Unit]] = {}
        victims: list[int] = []

        def head(tenant: str) -> Unit | None:
            """``tenant``'s least recently used unit not chosen yet (None: it has none)."""
            unit = heads.get(tenant)
            while unit is not None and any(d in chosen for d in unit[1]):
                unit = None  # chosen as another tenant's block part since: the next one
                heads.pop(tenant)
            if tenant not in heads:
                cursor = cursors.get(tenant)
                if cursor is None:
                    cursor = cursors[tenant] = self._units(tenant, unit_of, chosen, leaving)
                heads[tenant] = next(cursor, None)
            return heads[tenant]

        def evict(tenant: str) -> int:
            """Take ``tenant``'s head unit; the bytes it frees."""
            unit = heads.pop(tenant)
            assert unit is not None
            freed = 0
            for digest in unit[1]:
                size, owner = size_and_tenant(digest)
                delta[owner] -= size
                freed += size
            chosen.update(unit[1])
            victims.extend(unit[1])
            return freed

        def over_share(tenant: str) -> int:
            return held[tenant] + delta[tenant] - self.reserved.get(tenant, 0)

        def victim_tenant() -> str | None:
            """Whose unit goes next: the oldest head among the tenants over their share,
            else the writer's own."""
            best: tuple[int, str] | None = None
            for tenant in self.orders:
                if over_share(tenant) <= 0:
                    continue
                unit = head(tenant)
                if unit is not None and (best is None or unit[0] < best[0]):
                    best = (unit[0], tenant)
            if best is not None:
                return best[1]
            return writer if head(writer) is not None else None

        admitted = 0
        for size in sizes:
            needed = len(victims)  # the victims the objects admitted so far need
            if quota is not None:
                while held[writer] + delta[writer] + size > quota and head(writer) is not None:
                    projected -= evict(writer)
                if held[writer] + delta[writer] + size > quota:
                    del victims[needed:]  # nothing is evicted for an object refused
                    break  # the writer's own objects cannot make the room (being written)
            if projected + size > high:
                while projected + size > low:
                    tenant = victim_tenant()
                    if tenant is None:
                        break
                    projected -= evict(tenant)
            if projected + size > capacity:
                del victims[needed:]  # nothing is evicted for an object refused
                break  # this one will not be admitted, nor any after it
            projected += size
            delta[writer] += size
            admitted += 1
        return victims, admitted

    def _units(
        self,
        tenant: str,
        unit_of: Callable[[int], tuple[list[int], bool]],
        chosen: set[int],
        leaving: Container[int],
    ) -> Iterator[Unit]:
        """``tenant``'s objects in its LRU order, each with its block's other parts, pinned
        ones and those leaving or chosen passed over."""
        for digest, tick in self.orders.get(tenant, {}).items():
            if digest in chosen or digest in leaving:
                continue
            unit, pinned = unit_of(digest)
            if pinned or any(d in chosen or d in leaving for d in unit):
                continue
            yield tick, unit
