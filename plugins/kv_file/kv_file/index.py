"""The in-memory index: which objects are in the directory, their sizes, names and LRU order.

Every process that has the directory open keeps one, and applies the directory's journal
(:mod:`kv_file.journal`) to it in order, so all of them hold the same objects in the same
order; the bytes in flight (reservations) are in the shared ledger, not here. What is only
this process's: the names it learned for objects found by a scan, the objects a write in
progress acknowledges (pinned: eviction passes them over), and the times of its read hits,
which the backend writes to the files' mtimes in batches (:meth:`Index.take_touched`), so a
store rebuilt from a scan still knows their recency.

Each object belongs to the tenant whose write stored it (:mod:`kvcore.tenants`; the journal's
stored records say which), and the index counts each tenant's bytes. With tenants' shares
configured, eviction follows them (:mod:`kv_file.shares`).

After the first lookup a query is one dict probe per name, with no hashing and no system call.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kv_file.shares import Shares
from kvcore.keys import BlockId, ObjectName
from kvcore.tenants import DEFAULT_TENANT, TenantSettings

__all__ = ["Entry", "Index", "Unknown", "block_of"]


class Unknown(enum.Enum):
    """A name's block that the caller does not know: :class:`Index` parses the name."""

    BLOCK = "unknown block"


def block_of(name: str | None) -> BlockId | None:
    """The block an object belongs to, for names kvcore built: the objects of one block (K and
    V, scales) are evicted together, since a block missing one part is no block. None for
    other names (and unknown ones): such an object is its own unit. (Names reach the index as
    text: from the hook's requests and from the journal.)
    """
    if name is None:
        return None
    identity = ObjectName.parse(name)
    return None if identity is None else identity.block


@dataclass(slots=True)
class Entry:
    size: int
    name: str | None = None  # learned on first use; None for files found by a scan
    stamp: int = 0  # when it was indexed, so a scan that started earlier cannot drop it
    logged_touch: float = 0.0  # when this process last put a read of it in the journal
    block: BlockId | None = None  # see block_of
    tenant: str = DEFAULT_TENANT  # whose write stored it
    tick: int = 0  # with shares: when it was last added or read (the LRU order, as a number)


class Index:
    """Thread-safe; ``by_name`` may be probed without the lock (a dict probe is atomic)."""

    def __init__(
        self, capacity: int, high: float, low: float, tenants: TenantSettings | None = None
    ) -> None:
        self.capacity = capacity
        self.high_bytes = int(capacity * high)
        self.low_bytes = int(capacity * low)
        self.lock = threading.Lock()
        self.lru: OrderedDict[int, Entry] = OrderedDict()  # oldest first
        self.by_name: dict[str, int] = {}
        self.blocks: dict[BlockId, set[int]] = {}  # block_of(name) -> the digests of its parts
        self.files_bytes = 0  # bytes of the indexed files
        self.touched: dict[int, int] = {}  # digest -> wall-clock ns of its last read hit here
        self._stamps = itertools.count(1)
        self._pinned: Counter[int] = Counter()  # objects a write in progress acknowledges
        #: bytes of each tenant's objects
        self.tenant_bytes: Counter[str] = Counter()
        #: how many objects each tenant holds (a clear is done when its count is 0: an object
        #: may be empty, so its bytes cannot say)
        self._tenant_objects: Counter[str] = Counter()
        #: with shares configured: each tenant's order, and admissions planned by the shares
        self.shares = None if tenants is None or not tenants.tenants else Shares(tenants)
        #: tenants whose objects are being deleted (the journal's clearing records): none of
        #: their objects is served or stored (replaced whole, so it may be read unlocked)
        self.clearing: frozenset[str] = frozenset()
        self._ticks = itertools.count(1)

    def stamp(self) -> int:
        return next(self._stamps)

    # -- lookups ---------------------------------------------------------------------------

    def learn(self, name: str, digest: int) -> bool:
        """Remember ``name`` for ``digest`` if the digest is indexed; True when it is."""
        return not self.learn_each([name], [digest])

    def learn_many(
        self, names: list[str], digests: list[int], sizes: list[int | None] | None = None
    ) -> int:
        """:meth:`learn` in order under one lock; returns how many leading names are indexed.

        With ``sizes``, a digest indexed with another size than ``sizes[k]`` (unless None)
        also ends the run (the file there is not the object the name promises: the caller
        checks the disk).
        """
        with self.lock:
            for k, (name, digest) in enumerate(zip(names, digests, strict=True)):
                entry = self.lru.get(digest)
                if entry is None or (sizes is not None and sizes[k] not in (None, entry.size)):
                    return k
                if entry.name is None:
                    self._name(entry, digest, name)
        return len(names)

    def learn_each(self, names: list[str], digests: list[int]) -> list[int]:
        """:meth:`learn` for every pair under one lock; returns the positions whose digest is
        not indexed (read hits of files no record told of)."""
        unknown = []
        with self.lock:
            lru = self.lru
            for k, (name, digest) in enumerate(zip(names, digests, strict=True)):
                entry = lru.get(digest)
                if entry is None:
                    unknown.append(k)
                elif entry.name is None:
                    self._name(entry, digest, name)
        return unknown

    def size_of(self, digest: int) -> int | None:
        entry = self.lru.get(digest)
        return None if entry is None else entry.size

    def unname(self, name: str) -> None:
        """Forget that ``name`` is stored at the digest it was learned with (it was wrong)."""
        with self.lock:
            digest = self.by_name.pop(name, None)
            if digest is not None:
                entry = self.lru.get(digest)
                if entry is not None and entry.name == name:
                    self._unblock(digest, entry)
                    entry.name = None

    def named(self) -> list[tuple[int, str]]:
        with self.lock:
            return [(d, e.name) for d, e in self.lru.items() if e.name is not None]

    def unnamed(self) -> list[int]:
        with self.lock:
            return [d for d, e in self.lru.items() if e.name is None]

    def snapshot(self) -> list[tuple[int, int, str | None, str]]:
        """``(digest, size, name, tenant)`` of every object, least recently used first."""
        with self.lock:
            return [(d, e.size, e.name, e.tenant) for d, e in self.lru.items()]

    def holds(self, tenant: str) -> bool:
        """Whether any object of ``tenant`` is indexed (without a scan)."""
        with self.lock:
            return self._tenant_objects[tenant] > 0

    def of_tenant(self, tenant: str) -> list[int]:
        """The digests of ``tenant``'s objects."""
        with self.lock:
            if self.shares is not None:
                return list(self.shares.orders.get(tenant, ()))
            return [d for d, e in self.lru.items() if e.tenant == tenant]

    def withheld(self, digests: Iterable[int]) -> int | None:
        """The position of the first of ``digests`` whose object belongs to a tenant being
        cleared (None: none does; call only while :attr:`clearing` holds a tenant)."""
        clearing, lru = self.clearing, self.lru
        with self.lock:
            for k, digest in enumerate(digests):
                entry = lru.get(digest)
                if entry is not None and entry.tenant in clearing:
                    return k
        return None

    def set_clearing(self, tenant: str, clearing: bool) -> None:
        """``tenant``'s objects are being deleted (or no longer)."""
        with self.lock:
            now = set(self.clearing)
            if clearing:
                now.add(tenant)
            else:
                now.discard(tenant)
            self.clearing = frozenset(now)

    # -- changes (as the journal's records say) ---------------------------------------------

    def add_many(
        self,
        files: Iterable[tuple[int, int, str | None, bool, BlockId | Unknown | None, str | None]],
    ) -> None:
        """Index files now in place, each ``(digest, size, name, pin, block, tenant)`` in
        order under one lock, replacing what was at its digest. ``pin``: also pin it (see
        :meth:`hold`), atomically, so no eviction comes between. ``block``: :func:`block_of`
        the name, when the caller knows it (else it is parsed). ``tenant``: whose write stored
        it (None: not said, as for a file a scan found: the tenant of what it replaces, else
        the default tenant)."""
        with self.lock:
            add = self._add
            for digest, size, name, pin, block, tenant in files:
                add(digest, size, name, pin, block, tenant)

    def _add(
        self,
        digest: int,
        size: int,
        name: str | None,
        pin: bool,
        block: BlockId | Unknown | None,
        tenant: str | None,
    ) -> None:
        """One file of :meth:`add_many` (lock held)."""
        old = self.lru.pop(digest, None)
        if old is not None:  # replaced in place (a concurrent writer of the same name)
            self._uncount(digest, old)
            self._unblock(digest, old)
            if old.name is not None and old.name != name:
                self.by_name.pop(old.name, None)
            if name is None:
                name = old.name
            if tenant is None:
                tenant = old.tenant
        entry = self.lru[digest] = Entry(size, None, next(self._stamps))
        entry.tenant = DEFAULT_TENANT if tenant is None else tenant
        self.files_bytes += size
        self.tenant_bytes[entry.tenant] += size
        self._tenant_objects[entry.tenant] += 1
        if self.shares is not None:
            entry.tick = next(self._ticks)
            self.shares.add(entry.tenant, digest, entry.tick)
        if name is not None:
            self._name(entry, digest, name, block)
        if pin:
            self._pinned[digest] += 1

    def _uncount(self, digest: int, entry: Entry) -> None:
        """``entry`` (at ``digest``) leaves the index: its bytes are no longer held (lock
        held)."""
        self.files_bytes -= entry.size
        held = self.tenant_bytes[entry.tenant] - entry.size
        if held > 0:
            self.tenant_bytes[entry.tenant] = held
        else:
            del self.tenant_bytes[entry.tenant]
        left = self._tenant_objects[entry.tenant] - 1
        if left > 0:
            self._tenant_objects[entry.tenant] = left
        else:
            del self._tenant_objects[entry.tenant]
        if self.shares is not None:
            self.shares.drop(entry.tenant, digest)

    def drop(self, digest: int) -> Entry | None:
        """Forget a file that is gone; returns its entry (None if it was not indexed)."""
        with self.lock:
            entry = self.lru.pop(digest, None)
            if entry is None:
                return None
            self.touched.pop(digest, None)
            self._uncount(digest, entry)
            self._unblock(digest, entry)
            if entry.name is not None:
                self.by_name.pop(entry.name, None)
            return entry

    def touch_each(self, digests: Iterable[int]) -> None:
        """Most recently used now, in order (other processes' reads, as their records say)."""
        with self.lock:
            lru = self.lru
            if self.shares is not None:
                self._touch_shared(digests)
                return
            for digest in digests:
                if digest in lru:
                    lru.move_to_end(digest)

    def _touch_shared(self, digests: Iterable[int], now_ns: int | None = None) -> None:
        """A touch with shares configured: the tenant's order moves too (lock held)."""
        lru, touched, shares, ticks = self.lru, self.touched, self.shares, self._ticks
        assert shares is not None
        for digest in digests:
            entry = lru.get(digest)
            if entry is not None:
                lru.move_to_end(digest)
                entry.tick = next(ticks)
                shares.touch(entry.tenant, digest, entry.tick)
                if now_ns is not None:
                    touched[digest] = now_ns

    def touch_many(self, digests: Iterable[int], now_ns: int) -> None:
        """Read hits of this process at ``now_ns``, in order, under one lock: most recently
        used, and the time to save as their files' mtimes."""
        with self.lock:
            lru, touched = self.lru, self.touched
            if self.shares is not None:
                self._touch_shared(digests, now_ns)
                return
            for digest in digests:
                if digest in lru:
                    lru.move_to_end(digest)
                    touched[digest] = now_ns

    def due_for_log(self, digests: Iterable[int], now: float, every_s: float) -> list[int]:
        """The reads of ``digests`` that should go into the journal (at most one per
        ``every_s`` per object and process: recency that fine is all LRU needs)."""
        due = []
        with self.lock:
            lru = self.lru
            for digest in digests:
                entry = lru.get(digest)
                if entry is not None and now - entry.logged_touch >= every_s:
                    entry.logged_touch = now
                    due.append(digest)
        return due

    def clear(self) -> list[tuple[int, Entry]]:
        """Forget everything (a journal read from its start follows); returns what was."""
        with self.lock:
            old = list(self.lru.items())
            self.lru.clear()
            self.by_name.clear()
            self.blocks.clear()
            self.touched.clear()
            self.files_bytes = 0
            self.tenant_bytes.clear()
            self._tenant_objects.clear()
            self.clearing = frozenset()
            if self.shares is not None:
                self.shares.clear()
            return old

    def take_touched(self) -> dict[int, int]:
        """The read hits not yet written to disk (still indexed), and forget them."""
        with self.lock:
            touched, self.touched = self.touched, {}
            return touched

    # -- pins and eviction ------------------------------------------------------------------

    def hold(self, digest: int) -> bool:
        """Pin an indexed object until :meth:`unpin` (False: it is not indexed)."""
        with self.lock:
            if digest not in self.lru:
                return False
            self._pinned[digest] += 1
            return True

    def unpin(self, digests: Iterable[int]) -> None:
        """Let objects pinned by :meth:`add_many` or :meth:`hold` be evicted again."""
        with self.lock:
            for digest in digests:
                left = self._pinned[digest] - 1
                if left > 0:
                    self._pinned[digest] = left
                else:
                    del self._pinned[digest]

    def plan_admission(
        self,
        in_flight: int,
        sizes: list[int],
        leaving: frozenset[int] | set[int] = frozenset(),
        tenant: str = DEFAULT_TENANT,
    ) -> tuple[list[int], int]:
        """What admitting writes of ``sizes`` (in order) takes, with ``in_flight`` bytes
        reserved by writes already running: the LRU victims to evict first, and how many of
        the sizes fit then (a leading run).

        Eviction is as if the objects were written one by one: whenever the next one would
        pass the high watermark, LRU objects no write of this process holds (pinned) are
        evicted down to the low watermark, a block's parts together (:func:`block_of`: a part
        of a block some write holds keeps the whole block); nothing is evicted for a size
        that does not fit even then (it is refused, and so is every one after it).
        ``leaving``: objects an eviction of this process is handing over already: not chosen
        again, and still counted (the receiver may not take them). Nothing changes here: the caller deletes the victims'
        files, then records their eviction.

        With shares configured, ``tenant`` writes, and the victims are chosen by the shares
        (:meth:`kv_file.shares.Shares.plan`).
        """
        with self.lock:
            projected = self.files_bytes + in_flight
            if self.shares is not None:
                return self.shares.plan(
                    tenant,
                    sizes,
                    projected,
                    (self.capacity, self.high_bytes, self.low_bytes),
                    self.tenant_bytes,
                    self._unit_of,
                    self._size_and_tenant,
                    leaving,
                )
            if projected + sum(sizes) <= self.high_bytes:
                return [], len(sizes)
            candidates = self._eviction_units(leaving)
            victims: list[int] = []
            admitted = 0
            for size in sizes:
                needed = len(victims)  # the victims the objects admitted so far need
                if projected + size > self.high_bytes:
                    while projected + size > self.low_bytes:
                        unit = next(candidates, None)
                        if unit is None:
                            break
                        victims += unit
                        projected -= sum(self.lru[d].size for d in unit)
                if projected + size > self.capacity:
                    # this one will not be admitted, nor any after it, and nothing is evicted
                    # for it: writes in flight may hold more than every unpinned object frees
                    del victims[needed:]
                    break
                projected += size
                admitted += 1
            return victims, admitted

    def _unit_of(self, digest: int) -> tuple[list[int], bool]:
        """The objects evicted with ``digest`` (its block's parts), and whether one of them
        is pinned (lock held)."""
        entry = self.lru[digest]
        unit = [digest]
        if entry.block is not None:
            unit = sorted(self.blocks.get(entry.block, ()), key=lambda d: d != digest)
        return unit, any(d in self._pinned for d in unit)

    def _size_and_tenant(self, digest: int) -> tuple[int, str]:
        entry = self.lru[digest]
        return entry.size, entry.tenant

    def _eviction_units(self, leaving: frozenset[int] | set[int]) -> Iterator[list[int]]:
        """Unpinned objects in LRU order, each with the other parts of its block (lock held)."""
        seen = set(leaving)
        pinned = self._pinned
        for digest, entry in self.lru.items():
            if digest in seen:
                continue
            unit = [digest]
            if entry.block is not None:
                unit = sorted(self.blocks.get(entry.block, ()), key=lambda d: d != digest)
            seen.update(unit)
            if not any(d in pinned for d in unit):
                yield unit

    def _name(
        self, entry: Entry, digest: int, name: str, block: BlockId | Unknown | None = Unknown.BLOCK
    ) -> None:
        entry.name = name
        self.by_name[name] = digest
        entry.block = block_of(name) if block is Unknown.BLOCK else block
        if entry.block is not None:
            self.blocks.setdefault(entry.block, set()).add(digest)

    def _unblock(self, digest: int, entry: Entry) -> None:
        if entry.block is None:
            return
        siblings = self.blocks.get(entry.block)
        if siblings is not None:
            siblings.discard(digest)
            if not siblings:
                del self.blocks[entry.block]
        entry.block = None

    def __len__(self) -> int:
        return len(self.lru)
