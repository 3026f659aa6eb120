"""The in-memory index: which objects are on disk, their sizes, LRU order and the byte budget.

Rebuilt from a directory scan at open (file sizes and modification times). A read hit moves
an object to the recent end here and records when; the backend writes those times to the files'
mtimes later in one batch (:meth:`Index.take_touched`), so recency survives a restart without a
metadata write on every read. Names are learned as they are used: after the first
lookup a query is one dict probe per name, with no hashing and no system call.

The byte budget holds at every moment, not just on average: ``used`` counts every indexed
file and every write in flight, and an evicted file's bytes leave ``used`` only once the file
is deleted. Admissions are serialised (:meth:`Index.reserve`), so no write starts while the
files that make room for it still exist.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Entry", "Index"]


@dataclass(slots=True)
class Entry:
    size: int
    name: str | None = None  # learned on first use; None for files found by a scan
    stamp: int = 0  # insertion sequence, so a scan that started earlier cannot drop it


class Index:
    """Thread-safe; ``by_name`` may be probed without the lock (a dict probe is atomic).

    ``delete_files(digests)`` deletes evicted objects' files; it is called without the lock.
    """

    def __init__(
        self, capacity: int, high: float, low: float, delete_files: Callable[[list[int]], None]
    ) -> None:
        self.capacity = capacity
        self.high_bytes = int(capacity * high)
        self.low_bytes = int(capacity * low)
        self.lock = threading.Lock()
        self.lru: OrderedDict[int, Entry] = OrderedDict()  # oldest first
        self.by_name: dict[str, int] = {}
        self.used = 0  # bytes of indexed files, writes in flight and victims not yet deleted
        self.evictions = 0
        self.touched: dict[int, int] = {}  # digest -> wall-clock ns of its last read hit
        self.names_changed = 0  # bumped whenever by_name changes: when to save a snapshot
        self._stamps = itertools.count(1)
        self._pinned: Counter[int] = Counter()  # objects a write in progress acknowledges
        self._admission = threading.Lock()
        self._delete_files = delete_files

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

    def name_all(self, names: dict[int, str], fits: Callable[[str, int], bool] | None) -> int:
        """Give names (from a snapshot) to indexed digests that have none, where ``fits(name,
        size)`` says the file's size is one the name can have; returns how many were named."""
        named = 0
        with self.lock:
            for digest, entry in self.lru.items():
                if entry.name is None:
                    name = names.get(digest)
                    if (
                        name is not None
                        and name not in self.by_name
                        and (fits is None or fits(name, entry.size))
                    ):
                        entry.name = name
                        self.by_name[name] = digest
                        named += 1
            self.names_changed += named
        return named

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
                    entry.name = name
                    self.by_name[name] = digest
                    self.names_changed += 1
        return len(names)

    def unname(self, name: str) -> None:
        """Forget that ``name`` is stored at the digest it was learned with (it was wrong)."""
        with self.lock:
            digest = self.by_name.pop(name, None)
            if digest is not None:
                entry = self.lru.get(digest)
                if entry is not None and entry.name == name:
                    entry.name = None
                self.names_changed += 1

    def named(self) -> list[tuple[int, str]]:
        with self.lock:
            return [(d, e.name) for d, e in self.lru.items() if e.name is not None]

    def add(
        self, digest: int, size: int, name: str | None, *, reserved: bool, pin: bool = False
    ) -> None:
        """Index a file now on disk. ``reserved``: its bytes were counted by :meth:`reserve`.
        ``pin``: also pin it (see :meth:`pin`), atomically, so no eviction comes between."""
        with self.lock:
            self._add(digest, size, name, reserved=reserved)
            if pin:
                self._pinned[digest] += 1

    def hold(self, digest: int, size: int, name: str | None) -> None:
        """Pin a file found on disk with ``size`` bytes, indexing it first if needed."""
        with self.lock:
            entry = self.lru.get(digest)
            if entry is None or entry.size != size:
                self._add(digest, size, name, reserved=False)
            elif entry.name is None and name is not None and name not in self.by_name:
                entry.name = name
                self.by_name[name] = digest
                self.names_changed += 1
            self._pinned[digest] += 1

    def unpin(self, digests: Iterable[int]) -> None:
        """Let objects pinned by :meth:`add` or :meth:`hold` be evicted again."""
        with self.lock:
            for digest in digests:
                left = self._pinned[digest] - 1
                if left > 0:
                    self._pinned[digest] = left
                else:
                    del self._pinned[digest]

    def drop(self, digest: int, older_than: int | None = None) -> Entry | None:
        """Forget a file that is gone (or corrupt). ``older_than``: only if stamped before."""
        with self.lock:
            entry = self.lru.get(digest)
            if entry is None or (older_than is not None and entry.stamp >= older_than):
                return None
            return self._forget(digest)

    def reserve(self, size: int) -> bool:
        """:meth:`reserve_run` of one object: whether ``size`` bytes were reserved."""
        return self.reserve_run([size]) == 1

    def reserve_run(self, sizes: list[int]) -> int:
        """Count bytes for writes about to start: the leading run of ``sizes`` that fits.

        Eviction is as if the objects were written one by one: whenever the next one would pass
        the high watermark, LRU objects that no write in progress holds (pinned) are evicted
        down to the low watermark. Victims leave the index at once (no query counts them, no
        read finds them), their files are deleted, and only then do their bytes leave ``used``. Admissions wait
        for each other, so bytes on disk never exceed the capacity: nothing is admitted
        against room that victims' files still take. Returns how many sizes were reserved.
        """
        if not sizes:
            return 0
        with self._admission:
            with self.lock:
                victims = self._pick_victims(sizes)
            if victims:
                self._delete_files([digest for digest, _ in victims])
                with self.lock:
                    self.used -= sum(nbytes for _, nbytes in victims)
                    self.evictions += len(victims)
            admitted = 0
            with self.lock:
                for size in sizes:
                    if self.used + size > self.capacity:
                        break  # pinned objects and writes in flight hold the rest
                    self.used += size
                    admitted += 1
        return admitted

    def release(self, size: int) -> None:
        """Give back a reservation whose write failed (its temp file is already gone)."""
        with self.lock:
            self.used -= size

    # -- internals (lock held) -------------------------------------------------------------

    def _add(self, digest: int, size: int, name: str | None, *, reserved: bool) -> None:
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

    def _pick_victims(self, sizes: list[int]) -> list[tuple[int, int]]:
        """Unpinned LRU entries to evict before writing objects of ``sizes`` one by one;
        forgotten here, their bytes still counted in ``used`` until their files are gone."""
        projected = self.used
        if projected + sizes[0] <= self.high_bytes and projected + sum(sizes) <= self.high_bytes:
            return []
        candidates = ((d, e.size) for d, e in self.lru.items() if d not in self._pinned)
        victims: list[tuple[int, int]] = []
        for size in sizes:
            if projected + size > self.high_bytes:
                while projected + size > self.low_bytes:
                    victim = next(candidates, None)
                    if victim is None:
                        break
                    victims.append(victim)
                    projected -= victim[1]
            projected += size
            if projected > self.capacity:
                break  # this one will not be admitted, nor any after it
        for digest, _ in victims:
            self._forget(digest, keep_bytes=True)
        return victims

    def _forget(self, digest: int, *, keep_bytes: bool = False) -> Entry:
        entry = self.lru.pop(digest)
        self.touched.pop(digest, None)
        if not keep_bytes:
            self.used -= entry.size
        if entry.name is not None:
            self.by_name.pop(entry.name, None)
            self.names_changed += 1
        return entry

    def __len__(self) -> int:
        return len(self.lru)
