"""The in-memory index: which objects are on disk, their sizes, LRU order and the byte budget.

Rebuilt from a directory scan at open (file sizes and modification times). A read hit moves
an object to the recent end here and records when; the backend writes those times to the files'
mtimes later in one batch (:meth:`Index.take_touched`), so recency survives a restart without a
metadata write on every read. Names are learned as they are used: after the first
lookup a query is one dict probe per name, with no hashing and no system call.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Entry", "Index"]


@dataclass(slots=True)
class Entry:
    size: int
    name: str | None = None  # learned on first use; None for files found by a scan
    stamp: int = 0  # insertion sequence, so a scan that started earlier cannot drop it


class Index:
    """Thread-safe; ``by_name`` may be probed without the lock (a dict probe is atomic)."""

    def __init__(self, capacity: int, high: float, low: float) -> None:
        self.capacity = capacity
        self.high_bytes = int(capacity * high)
        self.low_bytes = int(capacity * low)
        self.lock = threading.Lock()
        self.lru: OrderedDict[int, Entry] = OrderedDict()  # oldest first
        self.by_name: dict[str, int] = {}
        self.used = 0  # bytes of indexed files plus reservations for writes in flight
        self.evictions = 0
        self.touched: dict[int, int] = {}  # digest -> wall-clock ns of its last read hit
        self.names_changed = 0  # bumped whenever by_name changes: when to save a snapshot
        self._stamps = itertools.count(1)

    def stamp(self) -> int:
        return next(self._stamps)

    # -- lookups ---------------------------------------------------------------------------

    def learn(self, name: str, digest: int) -> bool:
        """Remember ``name`` for ``digest`` if the digest is indexed; True when it is."""
        return self.learn_many([name], [digest]) == 1

    def touch(self, digest: int, now_ns: int) -> None:
        with self.lock:
            if digest in self.lru:
                self.lru.move_to_end(digest)
                self.touched[digest] = now_ns

    def take_touched(self) -> dict[int, int]:
        """The read hits not yet written to disk (still indexed), and forget them."""
        with self.lock:  # evicted entries already left it (_forget)
            touched, self.touched = self.touched, {}
            return touched

    # -- changes ---------------------------------------------------------------------------

    def load(self, found: Iterable[tuple[int, int, int]]) -> None:
        """Add scanned ``(digest, size, mtime_ns)`` files not yet indexed, oldest first."""
        with self.lock:
            fresh = [f for f in found if f[0] not in self.lru]
            fresh.sort(key=lambda f: f[2])
            for digest, size, _ in fresh:
                self.lru[digest] = Entry(size, None, self.stamp())
                self.used += size

    def name_all(self, names: dict[int, str]) -> int:
        """Give names to indexed digests that have none (from a snapshot); returns how many."""
        named = 0
        with self.lock:
            for digest, entry in self.lru.items():
                if entry.name is None:
                    name = names.get(digest)
                    if name is not None and name not in self.by_name:
                        entry.name = name
                        self.by_name[name] = digest
                        named += 1
            self.names_changed += named
        return named

    def learn_many(self, names: list[str], digests: list[int]) -> int:
        """:meth:`learn` in order under one lock; returns how many leading names are indexed."""
        with self.lock:
            for k, (name, digest) in enumerate(zip(names, digests, strict=True)):
                entry = self.lru.get(digest)
                if entry is None:
                    return k
                if entry.name is None:
                    entry.name = name
                    self.by_name[name] = digest
                    self.names_changed += 1
        return len(names)

    def named(self) -> list[tuple[int, str]]:
        with self.lock:
            return [(d, e.name) for d, e in self.lru.items() if e.name is not None]

    def add(self, digest: int, size: int, name: str | None, *, reserved: bool) -> None:
        """Index a file now on disk. ``reserved``: its bytes were counted by :meth:`reserve`."""
        with self.lock:
            old = self.lru.pop(digest, None)
            if old is not None:  # replaced in place (a concurrent writer of the same name)
                self.used -= old.size
                if old.name is not None and old.name != name:
                    self.by_name.pop(old.name, None)
            if not reserved:
                self.used += size
            self.lru[digest] = Entry(size, name, self.stamp())
            if name is not None:
                self.by_name[name] = digest
                self.names_changed += 1

    def drop(self, digest: int, older_than: int | None = None) -> Entry | None:
        """Forget a file that is gone (or corrupt). ``older_than``: only if stamped before."""
        with self.lock:
            entry = self.lru.get(digest)
            if entry is None or (older_than is not None and entry.stamp >= older_than):
                return None
            return self._forget(digest)

    def reserve(self, size: int) -> tuple[bool, list[int]]:
        """Count ``size`` bytes for a write about to start, evicting LRU entries if needed.

        Returns whether the bytes fit and the digests evicted (the caller deletes their files
        either way). It does not fit when it is larger than the budget or writes in flight
        hold the rest. Keeps ``used <= capacity`` at all times.
        """
        if size > self.capacity:
            return False, []
        victims: list[int] = []
        with self.lock:
            if self.used + size > self.high_bytes:
                while self.lru and self.used + size > self.low_bytes:
                    digest = next(iter(self.lru))
                    self._forget(digest)
                    victims.append(digest)
                self.evictions += len(victims)
            if self.used + size > self.capacity:
                return False, victims
            self.used += size
        return True, victims

    def release(self, size: int) -> None:
        """Give back a reservation whose write failed."""
        with self.lock:
            self.used -= size

    def _forget(self, digest: int) -> Entry:
        entry = self.lru.pop(digest)
        self.touched.pop(digest, None)
        self.used -= entry.size
        if entry.name is not None:
            self.by_name.pop(entry.name, None)
            self.names_changed += 1
        return entry

    def __len__(self) -> int:
        return len(self.lru)
