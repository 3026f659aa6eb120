"""The catalog: what a store directory holds, kept the same in every process that opens it.

The in-memory :class:`~kv_file.index.Index` answers lookups; the shared
:class:`~kv_file.journal.Journal` orders every change. Every change goes the same way: take
the journal's lock, read and apply what others recorded, do the change (delete victims' files,
reserve bytes), record it, apply the record. So every process's index holds the same objects
in the same LRU order, admissions in every process are serialised against one count of bytes
(files of every process plus every write in flight), and the journal is one ordered account of
the store that the backend reports as events (``kvcore_watch``), whoever made each change.

The backend moves bytes; the catalog knows what is where.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import kvcore
from kv_file.index import Entry, Index, Unknown
from kv_file.journal import Journal, JournalError, Kind, Record, record_bytes
from kv_file.objfile import header_size
from kv_file.objio import read_name
from kv_file.paths import StoreDir, discard
from kvcore import events as ev
from kvcore.keys import BlockId
from kvcore.tenants import DEFAULT_TENANT, TenantSettings

__all__ = ["Catalog"]

log = logging.getLogger("kvcore.file")

#: a read hit goes into the journal at most once per object and process in this interval
TOUCH_LOG_INTERVAL_S = 1.0
#: the journal is rewritten compactly when it passes this many bytes (or
#: :data:`_COMPACT_CAPACITY_SHARE` of the capacity, if less, but never below
#: :data:`_COMPACT_FLOOR_BYTES`)...
_COMPACT_MIN_BYTES = 256 << 10
_COMPACT_CAPACITY_SHARE = 32
_COMPACT_FLOOR_BYTES = 16 << 10
#: ...and this many times what its live objects need
_COMPACT_FACTOR = 4
#: what the file system allocates a file's bytes in, for counting the store's own files
_BLOCK = 4096

_EVENT_KINDS = {
    Kind.STORED: ev.STORED,
    Kind.EVICTED: ev.EVICTED,
    Kind.REMOVED: ev.REMOVED,
    Kind.GONE: ev.REMOVED,
}


class Catalog:
    """The shared index of one opened store (see the module docstring). Thread-safe.

    :param delete_files: deletes the object files of the given digests (evictions).
    """

    def __init__(
        self,
        store_dir: StoreDir,
        capacity: int,
        high: float,
        low: float,
        *,
        fits: frozenset[int] | None,
        retire_files: Callable[[list[int]], list[tuple[int, str]]],
        counters: kvcore.Counters,
        tenants: TenantSettings | None = None,
    ) -> None:
        self._dir = store_dir
        self.index = Index(capacity, high, low, tenants)
        self._fits = fits
        self._retire_files = retire_files
        self._unreserve = 0  # bytes of retired files deleted since, not yet given back
        self._counters = counters
        self.token = int.from_bytes(os.urandom(4), "little") or 1
        self.journal = Journal(
            store_dir.path, self.token, lambda: store_dir.meta_temp_path("journal")
        )
        self.report: Callable[..., None] | None = None
        #: where victims go before they leave (see :meth:`_admit_handing_over`): called with
        #: ``[(digest, name, size, object path, tenant)]`` and the write's deadline, outside
        #: the lock; returns the digests it took
        self.hand_over: (
            Callable[[list[tuple[int, str | None, int, str, str]], float | None], set[int]] | None
        ) = None
        self._leaving: set[int] = set()  # victims this process is handing over now
        self._watches: list[_Watch] = []  # writes in progress (see watch_writes)
        self.evictions = 0  # objects this process evicted
        self.evicted_by: Counter[str] = Counter()  # ... and their bytes, by their tenant
        #: the opened store that started each tenant's clear (the clearing record's origin)
        self.clearers: dict[str, int] = {}
        self.clears_running: Counter[str] = Counter()  # tenants this process is clearing now
        # stored records applied and their bytes in the journal: their mean sizes a rewrite
        self._stored_records = 0
        self._stored_record_bytes = 0
        # the journal is compacted sooner in a small store: its bytes count against capacity
        self._compact_min = max(
            _COMPACT_FLOOR_BYTES, min(_COMPACT_MIN_BYTES, capacity // _COMPACT_CAPACITY_SHARE)
        )
        self._ledger_bytes = 0  # what the ledger takes on the file system (measure_own_files)
        self.directory_bytes = 0  # what the directories take (reported, not counted)
        self.measure_own_files()
        with self._exclusive():
            pass  # the journal as it stands applied
        self.reconcile()

    # -- reading what others did -------------------------------------------------------------

    def sync(self) -> None:
        """Apply what other processes recorded since (one read of shared memory when nothing
        is new). Without the file lock where it can (:meth:`Journal.read_ahead`): a query or a
        write's start need what was committed when they began, not the lock, which writers of
        every process sharing the directory wait for; the lock only when the journal was
        replaced or a record was being published."""
        if not self.journal.behind():
            return
        with self.journal.mutex:
            records = self.journal.read_ahead()
            if records:
                self._apply(records)
                return
        with self._exclusive():
            pass

    def report_from_now(self, report: Callable[..., None]) -> None:
        """Report every record applied from now on (those before are the index as it is)."""
        with self._exclusive():
            self.report = report

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The journal locked and every record applied. What was committed before is read and
        applied first, without the lock (:meth:`Journal.read_ahead`): the processes sharing
        the directory then hold the lock for their own changes and the newest records only."""
        if self.journal.behind():
            with self.journal.mutex:
                records = self.journal.read_ahead()
                if records:
                    self._apply(records)
        with self.journal.locked():
            self._catch_up()
            if self._unreserve:
                self.journal.reserve(-self._unreserve)
                self._unreserve = 0
            yield

    def _catch_up(self) -> None:
        """Apply every record committed since the last call (lock held)."""
        if not self.journal.behind():
            return
        try:
            restart, records = self.journal.read_new()
        except JournalError as exc:
            log.warning(
                "kv_file: the journal of %s is damaged (%s); rebuilding it from a scan",
                self._dir.path,
                exc,
            )
            self._counters.add("journal_rebuilds")
            self._rebuild()
            return
        if restart:  # a new generation starts with a compact journal
            self._suspect_all()  # what happened between the generations is not in it
            before = dict(self.index.clear())
            self._apply(records, quiet=True)
            self._report_difference(before)
        else:
            self._apply(records)

    def _apply(
        self,
        records: Iterable[Record],
        *,
        pin: frozenset[int] = frozenset(),
        quiet: bool = False,
        blocks: Mapping[int, BlockId | None] | None = None,
    ) -> None:
        """Change the index as ``records`` say, and report the changes to a watcher.
        ``blocks``: the block of each stored object's name by digest, where the caller knows
        it (the index need not parse those names)."""
        index, token, watches, fits_sizes = self.index, self.token, self._watches, self._fits
        report = None if quiet else self.report
        # (kind, origin, tenant, names, sizes)
        runs: list[tuple[str, str, str | None, list[str], list[int]]] = []
        # consecutive stored and touched records go to the index as one call each (one lock
        # per run, not per record); a record of another kind applies them first, in order
        adds: list[tuple[int, int, str | None, bool, BlockId | Unknown | None, str | None]] = []
        touches: list[int] = []
        unknown = Unknown.BLOCK
        stored = stored_bytes = 0  # (locals: this loop runs once per record of every process)
        for r in records:
            kind, digest = r.kind, r.digest
            if kind is Kind.CLEARING or kind is Kind.CLEARED:  # a tenant's, no object's
                if adds:
                    index.add_many(adds)
                    adds = []
                if touches:
                    index.touch_each(touches)
                    touches = []
                cleared = (r.tenant or b"").decode("ascii", "replace") or DEFAULT_TENANT
                index.set_clearing(cleared, kind is Kind.CLEARING)
                self.clearers[cleared] = r.origin
                continue
            if kind is Kind.TOUCHED:
                if adds:
                    index.add_many(adds)
                    adds = []
                touches.append(digest)
                continue
            if touches:
                index.touch_each(touches)
                touches = []
            for watch in watches:
                if digest in watch.digests:
                    watch.touched.add(digest)
            if kind is Kind.STORED:
                raw, size = r.name, r.size
                name = None if raw is None else raw.decode("utf-8", "surrogatepass")
                # the index learns a name only for a file of a size its part can have (another
                # layout's object under the same name is never counted: a lookup removes it)
                fits = raw is not None and (
                    fits_sizes is None or size - header_size(len(raw)) in fits_sizes
                )
                pinned = digest in pin and r.origin == token
                block = unknown if blocks is None else blocks.get(digest, unknown)
                owner = r.tenant
                tenant = None if owner is None else owner.decode("ascii", "replace")
                adds.append((digest, size, name if fits else None, pinned, block, tenant))
                tenant = tenant or DEFAULT_TENANT
                stored += 1
                stored_bytes += record_bytes(
                    0 if raw is None else len(raw), 0 if owner is None else len(owner)
                )
            else:
                if adds:
                    index.add_many(adds)
                    adds = []
                entry = index.drop(digest)
                if entry is None:
                    continue
                name, size, tenant = entry.name, entry.size, entry.tenant
            if report is None or name is None:
                continue
            payload = size - header_size(len(name.encode("utf-8", "surrogatepass")))
            what, origin = _EVENT_KINDS[kind], ev.LOCAL if r.origin == token else ev.PEER
            if runs and runs[-1][:3] == (what, origin, tenant):
                runs[-1][3].append(name)
                runs[-1][4].append(payload)
            else:
                runs.append((what, origin, tenant, [name], [payload]))
        if adds:
            index.add_many(adds)
        if touches:
            index.touch_each(touches)
        self._stored_records += stored
        self._stored_record_bytes += stored_bytes
        if report is not None:
            for what, origin, tenant, names, sizes in runs:
                report(what, names, sizes, origin, tenant=tenant)

    def _report_difference(self, before: dict[int, Entry]) -> None:
        """After re-reading a replaced journal: report what came and went meanwhile."""
        report = self.report
        if report is None:
            return
        with self.index.lock:
            now = dict(self.index.lru)
        gone = [e for d, e in before.items() if d not in now and e.name is not None]
        came = [e for d, e in now.items() if d not in before and e.name is not None]
        for kind, entries in ((ev.EVICTED, gone), (ev.STORED, came)):
            if entries:
                names = [e.name for e in entries if e.name is not None]
                sizes = [e.size - header_size(len(n.encode("utf-8", "surrogatepass")))
                         for e, n in zip(entries, names, strict=True)]  # fmt: skip
                report(kind, names, sizes, ev.PEER)

    def _commit(
        self,
        records: list[Record],
        *,
        pin: frozenset[int] = frozenset(),
        blocks: Mapping[int, BlockId | None] | None = None,
    ) -> None:
        """Record ``records`` and apply them (lock held, caught up); ``blocks``: see
        :meth:`_apply`."""
        if not records:
            return
        self.journal.append(records)
        self._apply(records, pin=pin, blocks=blocks)
        self._maybe_compact()

    def _record_bytes_per_object(self) -> float:
        """What one object's record takes in a compact journal: the mean size of the stored
        records seen."""
        return self._stored_record_bytes / max(1, self._stored_records)

    def _journal_ceiling(self) -> int:
        """The size at which the journal is rewritten: :data:`_COMPACT_FACTOR` times what its
        rewrite would hold (one stored record per object), and never below the floor. It
        grows and shrinks with the objects only, not with the records appended since the last
        rewrite. Needs no lock (two integers and a dict's length)."""
        live = self._record_bytes_per_object() * len(self.index)
        return max(self._compact_min, int(_COMPACT_FACTOR * live))

    def _maybe_compact(self) -> None:
        """Rewrite the journal compactly once it has grown to its ceiling (one comparison
        per commit: the rewrite is O(objects)). A journal of a store that only grew is that
        rewrite already, and is left alone however long."""
        if self.journal.size < self._journal_ceiling():
            return
        self.journal.replace(self._records_of(self.index.snapshot()))
        self._counters.add("journal_compactions")

    def _records_of(self, live: Iterable[tuple[int, int, str | None, str]]) -> list[Record]:
        """A compact journal: every object, and every tenant clear not finished."""
        clearing = [
            Record(Kind.CLEARING, 0, origin=self.token, tenant=tenant_bytes(t))
            for t in sorted(self.index.clearing)
        ]
        return clearing + [
            Record(Kind.STORED, d, s, None if n is None else n.encode("utf-8", "surrogatepass"),
                   self.token, tenant_bytes(t))
            for d, s, n, t in live
        ]  # fmt: skip

    # -- deleting a tenant -------------------------------------------------------------------

    def start_clearing(self, tenant: str) -> None:
        """From now on, no process serves or stores ``tenant``'s objects (a durable record:
        a restart resumes the deletion, see :func:`kv_file.removal.clear_tenant`)."""
        with self._exclusive():
            if tenant not in self.index.clearing:
                self._commit([Record(Kind.CLEARING, 0, origin=self.token,
                                     tenant=tenant_bytes(tenant))])  # fmt: skip

    def orphaned_clears(self) -> list[str]:
        """Tenants whose clear no process is running: started by a store no longer open in a
        live process (it died mid-way), or by this one, which gave up (a removal failed)."""
        clearing, clearers, running = self.index.clearing, self.clearers, self.clears_running
        return sorted(
            t
            for t in clearing
            if not running[t]
            and (clearers.get(t) == self.token or not self.journal.alive(clearers.get(t, 0)))
        )

    def finish_clearing(self, tenant: str) -> bool:
        """Record that ``tenant``'s deletion is done, if no object of it is left (False: some
        are: delete them first)."""
        with self._exclusive():
            if self.index.holds(tenant):
                return False
            if tenant in self.index.clearing:
                self._commit([Record(Kind.CLEARED, 0, origin=self.token,
                                     tenant=tenant_bytes(tenant))])  # fmt: skip
            return True

    # -- the store's own files ---------------------------------------------------------------

    def measure_own_files(self) -> None:
        """Measure what the ledger takes on the file system (at open and at each full scan: it
        changes rarely). ``capacity_bytes`` bounds the store's files, so its bytes, and the
        journal's, are counted as in use. The directories are not: they are the file system's
        (no blocks on tmpfs, XFS or btrfs; one 4 KiB block each on ext4, 1 MiB a store, made
        once at open), and counting them would leave a small store on ext4 no room at all."""
        self._ledger_bytes = self.journal.ledger_bytes()
        self.directory_bytes = self._dir.directory_bytes()

    def own_bytes(self) -> int:
        """Bytes the store's own files take or may take: the ledger, the journal and the
        compact copy of it that a rewrite writes beside it (the old one's blocks are freed
        once the new one is in place).

        The journal counts at its ceiling (:meth:`_journal_ceiling`), the most it grows to
        before its next rewrite, and the copy at what a rewrite writes. So the room left to
        objects depends on how many objects there are, never on where the journal is between
        two rewrites: a full store holds as many objects just before a rewrite as just after
        it, instead of evicting objects for journal records as the journal grows and taking
        as many new ones once it shrinks. Needs no lock (integers and one read of the shared
        ledger); admission calls it under the lock.

        .. versionchanged:: 0.3 The journal counts at its ceiling, not at its current size
           (room for objects no longer follows the journal's cycle of growth and rewrite).
        """
        ceiling = self._journal_ceiling()
        journal = max(self.journal.size, ceiling)
        return self._ledger_bytes + _blocks(journal) + _blocks(ceiling // _COMPACT_FACTOR)

    def own_bytes_per_object(self) -> float:
        """What each object adds to :meth:`own_bytes` once the journal's ceiling is past its
        floor: its share of the journal at the ceiling and of the compact copy."""
        return (_COMPACT_FACTOR + 1) * self._record_bytes_per_object()

    def own_bytes_base(self) -> int:
        """What :meth:`own_bytes` counts beside the objects' shares once the journal's ceiling
        is past its floor: the ledger, and a file system block for each of the journal and
        its copy (their sizes round up to one)."""
        return self._ledger_bytes + 2 * _BLOCK

    def _beside_files(self) -> int:
        """What counts against the capacity beside the indexed files (lock held): every
        process's writes in flight and the store's own files."""
        return self.journal.reserved() + self.own_bytes()

    # -- changes this process makes -----------------------------------------------------------

    def admit(
        self,
        sizes: list[int],
        touched: Sequence[int] = (),
        deadline: float | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> int:
        """Reserve bytes for writes of ``sizes`` (in order) by ``tenant``, evicting LRU
        objects first as needed (by the tenants' shares, where configured); returns how many
        (a leading run) were admitted. ``touched``: objects the write skips as already stored,
        now most recently used. With :attr:`hand_over` set, victims are handed over before
        they leave (see :meth:`_admit_handing_over`), by ``deadline``.
        """
        if self.hand_over is not None:
            return self._admit_handing_over(sizes, touched, deadline, tenant)
        retired: list[tuple[int, str]] = []
        with self._exclusive():
            victims, admitted = self.index.plan_admission(
                self._beside_files(), sizes, tenant=tenant
            )
            victim_bytes = 0
            if victims:
                self._count_evicted(victims)
                # Renamed away from their names under the lock (a rename costs a fraction of
                # an unlink, which frees the pages); their bytes stay reserved until the
                # temp files are deleted, after the lock (a crash leaves stale temps, which the
                # next scan deletes, and a slot the scan reaps).
                victim_bytes = sum(self.index.size_of(d) or 0 for d in victims)
                retired = self._retire_files(victims)
                self.evictions += len(victims)
            records = [Record(Kind.EVICTED, d, origin=self.token) for d in victims]
            records += [Record(Kind.TOUCHED, d, origin=self.token) for d in touched]
            self._commit(records)
            self.journal.reserve(sum(sizes[:admitted]) + victim_bytes)
        self._delete_retired(retired, victim_bytes)
        return admitted

    def _admit_handing_over(
        self, sizes: list[int], touched: Sequence[int], deadline: float | None, tenant: str
    ) -> int:
        """:meth:`admit` for a store in front of another: each victim reaches the receiver
        before it leaves this store, so no crash can lose it.

        Under the lock, the victims are chosen (marked as leaving, so no other write of this
        process chooses them too) and the write's bytes reserved. Outside it, the victims are
        handed over from their files, which are still in place (another process may read
        them meanwhile, or evict them too: the receiver may get a block twice, never zero
        times). Under the lock again, only the victims the receiver took are retired and
        recorded as evicted; what it did not take (it failed, or ran out of time) stays, and
        the write keeps only the leading run that still fits: a full store with nowhere to
        put its victims refuses writes rather than lose blocks.
        """
        hand_over = self.hand_over
        assert hand_over is not None
        with self._exclusive():
            victims, admitted = self.index.plan_admission(
                self._beside_files(), sizes, self._leaving, tenant
            )
            self._commit([Record(Kind.TOUCHED, d, origin=self.token) for d in touched])
            self.journal.reserve(sum(sizes[:admitted]))
            if not victims:
                return admitted
            known = {
                d: (e.name, e.size, e.tenant)
                for d in victims
                if (e := self.index.lru.get(d)) is not None
            }
            self._leaving.update(victims)
        taken: set[int] = set()
        try:
            offered = [
                (d, name, size, self._dir.object_path(d), tenant)
                for d in victims
                if d in known
                for name, size, tenant in [known[d]]
            ]
            taken = hand_over(offered, deadline)
        except Exception as exc:  # nothing leaves: the write takes what fits without it
            self._counters.add("evict_handover_errors")
            log.warning("kv_file: handing evicted objects over failed: %s", exc)
        retired: list[tuple[int, str]] = []
        victim_bytes = 0
        with self._exclusive():
            self._leaving.difference_update(victims)
            leave = [d for d in victims if d in taken and self.index.size_of(d) is not None]
            if leave:
                self._count_evicted(leave)
                victim_bytes = sum(self.index.size_of(d) or 0 for d in leave)
                retired = self._retire_files(leave)
                self.evictions += len(leave)
                self._commit([Record(Kind.EVICTED, d, origin=self.token) for d in leave])
                self.journal.reserve(victim_bytes)
            kept = len(victims) - len(leave)
            if kept:
                self._counters.add("evict_kept_not_handed_over", kept)
                over = self.index.files_bytes + self._beside_files() - self.index.capacity
                while admitted and over > 0:
                    admitted -= 1
                    over -= sizes[admitted]
                    self.journal.reserve(-sizes[admitted])
        self._delete_retired(retired, victim_bytes)
        return admitted

    def _count_evicted(self, victims: list[int]) -> None:
        """Count victims' bytes by their tenant (lock held, before their records)."""
        lru = self.index.lru
        for digest in victims:
            entry = lru.get(digest)
            if entry is not None:
                self.evicted_by[entry.tenant] += entry.size

    def _delete_retired(self, retired: list[tuple[int, str]], victim_bytes: int) -> None:
        """Delete evicted objects' retired files (outside the lock) and give their bytes back."""
        for _, path in retired:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if victim_bytes:
            with self.journal.mutex:  # given back by the next locked section of this process
                self._unreserve += victim_bytes

    @contextlib.contextmanager
    def watch_writes(self, digests: Iterable[int]) -> Iterator[_Watch]:
        """Watch the records about objects being written, from before their files are renamed
        into place until :meth:`stored` records them: only a record about an object (another
        process stored it too and someone evicted or removed it, a scan adopted it) can mean
        its file left after the rename. Yields what :meth:`stored` takes."""
        watch = _Watch(frozenset(digests))
        with self.journal.mutex:
            self._watches.append(watch)
        try:
            yield watch
        finally:
            with self.journal.mutex:
                self._watches.remove(watch)

    def _suspect_all(self) -> None:
        """Records may have been missed (the journal was replaced or rebuilt): every object a
        write in progress watches is looked at again."""
        for watch in self._watches:
            watch.touched.update(watch.digests)

    def stored(
        self,
        files: Sequence[tuple[int, int, bytes | None]],
        watch: _Watch | None = None,
        blocks: Mapping[int, BlockId | None] | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> set[int]:
        """Written files ``(digest, size, name)`` are in place: their reservations become
        files, recorded in one go and pinned (kept from eviction until
        :meth:`Index.unpin`). Returns the digests not recorded: files gone already, because
        another process evicted or removed what was at their place after the rename (it may
        have been another writer's copy of the same object), so they are not acknowledged.

        With the ``watch`` (:meth:`watch_writes`) that covered the renames, only files some
        record was about since are looked for (an ``lstat`` each, under the lock); without
        it, every file is. ``blocks``: each file's block by digest, where the caller knows it
        (see :meth:`_apply`). ``tenant``: whose write stored them."""
        if not files:
            return set()
        owner = tenant_bytes(tenant)
        with self._exclusive():
            self.journal.reserve(-sum(size for _, size, _ in files))
            if tenant in self.index.clearing:  # deleted as it arrives: refused
                for d, _, _ in files:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._dir.object_path(d))
                self._counters.add("write_refused_tenant_clearing", len(files))
                return {d for d, _, _ in files}
            lost = {
                d
                for d, _, _ in files
                if (watch is None or d in watch.touched)
                and not _regular_file(self._dir.object_path(d))
            }
            if lost:
                self._counters.add("write_lost", len(lost))
            records = [
                Record(Kind.STORED, d, size, name, self.token, owner)
                for d, size, name in files
                if d not in lost
            ]
            self._commit(records, pin=frozenset(r.digest for r in records), blocks=blocks)
        return lost

    def release(self, size: int) -> None:
        """Give back the reservation of a write that failed (its temp file is gone)."""
        with self.journal.locked():
            self.journal.reserve(-size)

    def adopted(self, files: Sequence[tuple[int, int, bytes | None]]) -> None:
        """Files found in place that the index lacked (a write this process could not see
        recorded: an older kv_file, a crash between rename and record)."""
        if files:
            with self._exclusive():
                fresh = [(d, s, n) for d, s, n in files if self.index.size_of(d) != s]
                self._commit([Record(Kind.STORED, d, s, n, self.token) for d, s, n in fresh])
            self._counters.add("adopted", len(files))

    def read(self, digests: Iterable[int]) -> None:
        """Read hits: most recently used, here now and for every process soon."""
        now = time.monotonic()
        due = self.index.due_for_log(digests, now, TOUCH_LOG_INTERVAL_S)
        if due:
            with self._exclusive():
                self._commit([Record(Kind.TOUCHED, d, origin=self.token) for d in due])

    def gone(self, digests: Iterable[int], kind: Kind = Kind.GONE) -> None:
        """Objects no longer in place: removed by this process (``REMOVED``), or found
        missing or not what their name promises (``GONE``)."""
        digests = list(digests)
        if digests:
            with self._exclusive():
                # checked again under the lock: a writer may have put the object back since
                # (its record then stands, and the object is there)
                gone = [
                    d
                    for d in digests
                    if self.index.size_of(d) is not None
                    and not _regular_file(self._dir.object_path(d))
                ]
                self._commit([Record(kind, d, origin=self.token) for d in gone])

    # -- a full scan --------------------------------------------------------------------------

    def reconcile(self) -> None:
        """Make the catalog match the directory: adopt files no record mentions (with their
        names, from the snapshot or their headers), forget files that are gone, free the
        reservations of processes that died. Corrects what a crash left; cheap otherwise."""
        mark = self.index.stamp()
        with self.index.lock:
            known = set(self.index.lru)
        strays: list[str] = []
        found = list(self._dir.scan(skip=known, strays=strays))
        seen = {f.digest for f in found}
        # oldest first: a store without a journal (kv_file < 0.3) keeps its LRU order
        fresh = sorted((f for f in found if f.size >= 0), key=lambda f: f.mtime_ns)
        adopt: list[tuple[int, int, bytes | None]] = []
        for f in fresh:
            raw = read_name(self._dir.object_path(f.digest))  # the file's own word
            if raw is None:
                strays.append(self._dir.object_path(f.digest))  # no valid object of any name
                continue
            adopt.append((f.digest, f.size, raw))
        self._dir.remove_stale_temps()
        self.measure_own_files()
        with self._exclusive():
            records = []
            with self.index.lock:
                lost = [
                    d
                    for d in known - seen
                    if d in self.index.lru and self.index.lru[d].stamp < mark
                ]
            records += [
                Record(Kind.GONE, d, origin=self.token)
                for d in lost
                if not _regular_file(self._dir.object_path(d))  # gone, or a stray now
            ]
            records += [
                Record(Kind.STORED, d, s, n, self.token)
                for d, s, n in adopt
                if self.index.size_of(d) is None and _regular_file(self._dir.object_path(d))
            ]
            self.journal.reap()
            self.journal.scanned(time.time_ns())
            self._commit(records)
        for path in strays:
            try:
                if discard(path):
                    self._counters.add("foreign_removed")
            except OSError as exc:
                log.warning("kv_file cannot remove %s: %s", path, exc)
        self._counters.add("rescans")
        self._counters.add("adopted", len(adopt))

    def scan_due(self, interval_s: float) -> bool:
        """Whether no process sharing the directory ran a full scan in ``interval_s``."""
        return time.time_ns() - self.journal.last_scan_ns >= interval_s * 1e9

    def _rebuild(self) -> None:
        """A new journal from the directory (lock held): the old one did not parse."""
        self._suspect_all()
        self.index.clear()
        records = [
            Record(Kind.STORED, f.digest, f.size, read_name(self._dir.object_path(f.digest)),
                   self.token)
            for f in sorted(self._dir.scan(), key=lambda f: f.mtime_ns)
        ]  # fmt: skip
        self.journal.replace(records)
        self._apply(records, quiet=True)

    # -- bytes -------------------------------------------------------------------------------

    def used(self) -> int:
        """Bytes of every object file in place and every write in flight, in every process
        (the store's own files aside: :meth:`own_bytes`)."""
        with self._exclusive():
            return self.index.files_bytes + self.journal.reserved()

    def close(self) -> None:
        self.report = None
        self.journal.close()


class _Watch:
    """The objects a write is storing, and those of them some record was about since."""

    __slots__ = ("digests", "touched")

    def __init__(self, digests: frozenset[int]) -> None:
        self.digests = digests
        self.touched: set[int] = set()


def tenant_bytes(tenant: str) -> bytes | None:
    """``tenant`` as a stored record names it (None: the default tenant, in no bytes)."""
    return None if tenant == DEFAULT_TENANT else tenant.encode("ascii")


def _blocks(nbytes: int) -> int:
    """``nbytes`` rounded up to whole file system blocks."""
    return -(-nbytes // _BLOCK) * _BLOCK


def _regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
