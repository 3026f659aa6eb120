"""The journal: one ordered record of every change to a store directory, shared by every
process that has the directory open.

Processes sharing a root (an engine's tensor-parallel ranks, replicas on one node) must agree
on the bytes in use, so that ``capacity_bytes`` bounds the directory and not each process;
evict in one order; see each other's writes, removals and evictions at once; and a router
following any one of them must see every change, in one order. Each process keeps its own
in-memory index (:mod:`kv_file.index`); every change any process makes goes through the
journal, and every process applies the journal's records in order, so every index is the same.

Two files in the namespace directory, both 0600:

- ``ledger`` (64 KiB, mapped shared): the journal's generation and committed length, the time
  of the last full scan, and a slot per opened store: its token, pid, the start time of its
  process and the bytes it has reserved for writes in flight.
- ``journal``: records, appended under an exclusive ``flock`` of the ledger; readers read up
  to the committed length. Bytes below the committed length never change within a
  generation, so a reader may read them without the lock (:meth:`Journal.read_ahead`) and take
  the lock only for what was committed after: the lock is held for the few newest records,
  not for everything the other processes did since. Each record is 40 bytes (length u32, kind u8, flags u8, the
  tenant's length u8, 1 spare, the file digest as two u64, the file's size u64, the origin's
  token u32, the name's length u32) followed by the name's bytes and the tenant's (stored
  records only), padded to 8 bytes. A stored record names the tenant whose write stored the
  object (:mod:`kvcore.tenants`; none: :data:`~kvcore.tenants.DEFAULT_TENANT`); a reader of
  kv_file < 0.3 skips the tenant's bytes with the padding (the record's length covers them)
  and reads the byte as spare. Nothing in either file is ever executed or unpickled.

What survives what:

- SIGKILL of any process: the kernel drops its lock; bytes it wrote past the committed length
  are ignored (the next writer overwrites them); its slot's reservation is released by the next
  full scan, which finds its process gone (pid and start time no longer match) and adopts or
  forgets the files it left.
- A journal that does not parse (power loss tore it, someone edited it): the store rebuilds it
  from a directory scan, as a store without a journal does.
- Growth: when the records pass four times what the live objects need, the appender writes a
  compact journal (one stored record per object, in LRU order) beside it and renames it over
  the old one, bumping the generation: readers that see a new generation re-read from its start.

A store on a read-only root, or whose ledger cannot be created, keeps a private journal in
memory: it then shares nothing, as before the journal existed.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

__all__ = ["Journal", "JournalError", "Kind", "Record", "record_bytes"]

log = logging.getLogger("kvcore.file")

LEDGER_BYTES = 1 << 16
_MAGIC = b"KVCJ"
_VERSION = 1
#: magic, version, generation, committed length, last full scan (wall ns)
_HEAD = struct.Struct("<4sIQQQ")
_GEN_TAIL = struct.Struct("<QQ")
_GEN_AT = 8
_SCAN_AT = 24
_SLOTS_USED_AT = 32  # u32: slots [0, used) may be held; claims take the lowest free one
_SLOTS_AT = 64
#: token, pid, process start time (clock ticks since boot), reserved bytes, spare
_SLOT = struct.Struct("<IIQQQ")
NUM_SLOTS = (LEDGER_BYTES - _SLOTS_AT) // _SLOT.size
_REC = struct.Struct("<IBBBxQQQII")
_MASK64 = (1 << 64) - 1


class Kind(enum.IntEnum):
    STORED = 1  # a file is in place (written, or adopted by a scan)
    EVICTED = 2  # deleted to make room
    REMOVED = 3  # deleted by remove or clear
    TOUCHED = 4  # read (or skipped by a write): most recently used now
    GONE = 5  # found missing by a scan or a lookup (deleted by hand, a crash mid-way)
    #: a tenant's objects are being deleted (``Record.tenant``; no digest): from here on no
    #: process serves or stores them, until...
    CLEARING = 6
    #: ...every object of the tenant is removed (kv_file >= 0.3; an older reader rebuilds)
    CLEARED = 7


def record_bytes(name_len: int, tenant_len: int = 0) -> int:
    """What a record with a name of ``name_len`` bytes (and a tenant's of ``tenant_len``)
    takes in the journal."""
    return -(-(_REC.size + name_len + tenant_len) // 8) * 8


@dataclass(slots=True)
class Record:
    kind: Kind
    digest: int
    size: int = 0
    name: bytes | None = None
    origin: int = 0
    #: the tenant whose write stored the object (stored records; None: the default tenant),
    #: as ASCII: a tenant's name (:data:`kvcore.tenants.TENANT_NAME`) is at most 64 bytes
    tenant: bytes | None = None

    def encode(self) -> bytes:
        return encode_records((self,))


_PADDING = [bytes(n) for n in range(8)]


def encode_records(records: Iterable[Record]) -> bytes:
    """``records`` as the journal holds them, one after another (a batch's records in one
    call: this runs once per object a write stores)."""
    pack, head = _REC.pack, _REC.size
    parts: list[bytes] = []
    append = parts.append
    for r in records:
        name = r.name or b""
        tenant = r.tenant or b""
        digest, n, t = r.digest, len(name), len(tenant)
        length = (head + n + t + 7) & ~7  # record_bytes(n, t)
        append(pack(length, r.kind, 0, t, digest & _MASK64, digest >> 64, r.size, r.origin, n))
        append(name)
        if t:
            append(tenant)
        append(_PADDING[length - head - n - t])
    return b"".join(parts)


class JournalError(Exception):
    """The journal does not parse: rebuild it from a scan."""


def decode(data: bytes | memoryview) -> list[Record]:
    """Every record of ``data`` (whole records only; raises JournalError on damage)."""
    out = []
    pos, end = 0, len(data)
    unpack, size = _REC.unpack_from, _REC.size
    kinds = {k.value: k for k in Kind}
    while pos < end:
        if end - pos < size:
            raise JournalError(f"a record header is cut at byte {pos}")
        length, kind, _, tenant_len, lo, hi, fsize, origin, name_len = unpack(data, pos)
        if (
            length < size + name_len + tenant_len
            or length % 8
            or pos + length > end
            or kind not in kinds
        ):
            raise JournalError(f"no valid record at byte {pos}")
        at = pos + size + name_len
        name = bytes(data[pos + size : at]) if name_len else None
        tenant = bytes(data[at : at + tenant_len]) if tenant_len else None
        out.append(Record(kinds[kind], lo | (hi << 64), fsize, name, origin, tenant))
        pos += length
    return out


class Journal:
    """The shared ledger and journal of one directory, as one opened store uses them.

    Every method but :meth:`behind` needs :meth:`locked` held. ``token`` identifies this
    opened store in records (``Record.origin``) and in its ledger slot.
    """

    def __init__(self, directory: str, token: int, temp_path: Callable[[], str]) -> None:
        self.token = token
        self._temp_path = temp_path  # a fresh temp name in the directory (crashes: removed)
        self._ledger_path = os.path.join(directory, "ledger")
        self._journal_path = os.path.join(directory, "journal")
        #: this process's threads take turns on the reader's position (with or without flock)
        self.mutex = threading.Lock()
        self._gen = 0  # the generation applied, 0: none yet
        self._pos = 0  # committed bytes applied
        self._slot = -1
        self._fd: int | None = None
        self._jfd: int | None = None
        self._private: bytearray | None = None
        try:
            self._fd = os.open(
                self._ledger_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
            )
            with self._flocked():
                if os.fstat(self._fd).st_size < LEDGER_BYTES:
                    os.ftruncate(self._fd, LEDGER_BYTES)  # zeros; a racing creator does the same
                self._map = mmap.mmap(self._fd, LEDGER_BYTES, mmap.MAP_SHARED)
                if _HEAD.unpack_from(self._map)[:2] != (_MAGIC, _VERSION):
                    self._start_new_journal()
                self._claim_slot()
        except OSError as exc:
            log.info(
                "kv_file: %s cannot be shared (%s); this process keeps its own journal",
                self._ledger_path,
                exc,
            )
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
            self._fd = None
            self._map = mmap.mmap(-1, LEDGER_BYTES)
            self._private = bytearray()
            self._start_new_journal()
            self._claim_slot()

    @property
    def shared(self) -> bool:
        return self._fd is not None

    # -- locking -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _flocked(self) -> Iterator[None]:
        if self._fd is None:
            yield
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive use of the journal and ledger: by this thread, and this process."""
        with self.mutex, self._flocked():
            yield

    # -- reading -----------------------------------------------------------------------------

    def behind(self) -> bool:
        """Whether records were committed that this store has not read (no lock, no system
        call: one read of the shared mapping)."""
        return _GEN_TAIL.unpack_from(self._map, _GEN_AT) != (self._gen, self._pos)

    def read_new(self) -> tuple[bool, list[Record]]:
        """``(restart, records)``: the records committed since the last call. ``restart``:
        the journal was replaced (a compaction, a rebuild); ``records`` is then the whole
        new journal, and what was applied before must be forgotten first.

        :raises JournalError: the journal does not parse.
        """
        gen, tail = _GEN_TAIL.unpack_from(self._map, _GEN_AT)
        restart = gen != self._gen
        if restart:
            self._reopen()
            self._gen, self._pos = gen, 0
        if tail < self._pos:
            raise JournalError(f"the committed length {tail} is behind this reader ({self._pos})")
        data = self._read(self._pos, tail - self._pos)
        if len(data) != tail - self._pos:
            raise JournalError(f"the journal holds {self._pos + len(data)} of {tail} bytes")
        records = decode(data)
        self._pos = tail
        return restart, records

    def read_ahead(self) -> list[Record]:
        """The records committed since the last read, read without the file lock (hold
        :attr:`mutex`): only within the generation this reader has open, whose bytes below the
        committed length never change. ``[]`` when there is nothing, when the journal was
        replaced since (the locked :meth:`read_new` restarts from the new one), or when what
        was read does not parse as whole records (a length read while it was being
        published): the locked read then takes it up from the same position."""
        published = _GEN_TAIL.unpack_from(self._map, _GEN_AT)
        gen, tail = published
        if gen != self._gen or tail <= self._pos:
            return []
        if _GEN_TAIL.unpack_from(self._map, _GEN_AT) != published:
            return []  # moving under us: leave it to the lock
        data = self._read(self._pos, tail - self._pos)
        if len(data) != tail - self._pos:
            return []
        try:
            records = decode(data)
        except JournalError:
            return []
        self._pos = tail
        return records

    # -- writing -----------------------------------------------------------------------------

    def append(self, records: Iterable[Record]) -> None:
        """Commit ``records`` after everything read (call :meth:`read_new` first)."""
        data = encode_records(records)
        if not data:
            return
        assert not self.behind(), "append without reading the journal first"
        self._write(self._pos, data)
        self._pos += len(data)
        _GEN_TAIL.pack_into(self._map, _GEN_AT, self._gen, self._pos)

    def replace(self, records: Iterable[Record]) -> None:
        """Start a new generation holding exactly ``records`` (a compaction or a rebuild)."""
        data = encode_records(records)
        if self._private is not None:
            self._private[:] = data
        else:
            temp = self._temp_path()
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.rename(temp, self._journal_path)
            if self._jfd is not None:
                # the old journal's blocks freed now, not when the last process that has it
                # open reads on (a reader of the old generation then reads short, which
                # read_ahead takes as nothing new, and the new generation is read under the lock)
                os.ftruncate(self._jfd, 0)
        gen = _GEN_TAIL.unpack_from(self._map, _GEN_AT)[0] + 1
        _GEN_TAIL.pack_into(self._map, _GEN_AT, gen, len(data))
        self._reopen()
        self._gen, self._pos = gen, len(data)

    def _start_new_journal(self) -> None:
        _HEAD.pack_into(self._map, 0, _MAGIC, _VERSION, 0, 0, 0)
        self.replace(())

    def ledger_bytes(self) -> int:
        """What the shared ledger takes on the file system (0 for a private journal)."""
        if self._fd is None:
            return 0
        return os.fstat(self._fd).st_blocks * 512

    @property
    def size(self) -> int:
        """Committed bytes of the journal."""
        return _GEN_TAIL.unpack_from(self._map, _GEN_AT)[1]

    def _reopen(self) -> None:
        if self._private is not None:
            return
        if self._jfd is not None:
            os.close(self._jfd)
        self._jfd = os.open(self._journal_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _read(self, pos: int, n: int) -> bytes:
        if self._private is not None:
            return bytes(self._private[pos : pos + n])
        assert self._jfd is not None
        chunks = []
        while n > 0:
            chunk = os.pread(self._jfd, n, pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def _write(self, pos: int, data: bytes) -> None:
        if self._private is not None:
            del self._private[pos:]
            self._private += data
            return
        assert self._jfd is not None
        view = memoryview(data)
        while view:
            n = os.pwrite(self._jfd, view, pos)
            view = view[n:]
            pos += n

    # -- the last full scan -------------------------------------------------------------------

    @property
    def last_scan_ns(self) -> int:
        return struct.unpack_from("<Q", self._map, _SCAN_AT)[0]

    def scanned(self, when_ns: int) -> None:
        struct.pack_into("<Q", self._map, _SCAN_AT, when_ns)

    # -- reservations --------------------------------------------------------------------------

    def _slots(self, upto: int = NUM_SLOTS) -> Iterator[tuple[int, tuple[int, int, int, int, int]]]:
        for i in range(upto):
            yield i, _SLOT.unpack_from(self._map, _SLOTS_AT + i * _SLOT.size)

    def _slots_used(self) -> int:
        return min(struct.unpack_from("<I", self._map, _SLOTS_USED_AT)[0], NUM_SLOTS)

    def _set_slots_used(self) -> None:
        """Recount the high-water mark from the slots themselves (self-healing: whatever a
        killed process left half-done, the slots are the truth)."""
        used = 0
        for i, (token, *_rest) in self._slots():
            if token:
                used = i + 1
        struct.pack_into("<I", self._map, _SLOTS_USED_AT, used)

    def _claim_slot(self) -> None:
        pid, start = os.getpid(), _process_start(os.getpid())
        for i, (token, spid, sstart, _, _) in self._slots():
            if token == 0 or not _alive(spid, sstart):
                _SLOT.pack_into(self._map, _SLOTS_AT + i * _SLOT.size, self.token, pid, start, 0, 0)
                self._slot = i
                self._set_slots_used()
                return
        raise OSError(f"all {NUM_SLOTS} ledger slots are held by live processes")

    def reserve(self, nbytes: int) -> None:
        """Add ``nbytes`` (negative: give back) to this store's bytes in flight."""
        at = _SLOTS_AT + self._slot * _SLOT.size
        token, pid, start, reserved, spare = _SLOT.unpack_from(self._map, at)
        _SLOT.pack_into(self._map, at, token, pid, start, max(0, reserved + nbytes), spare)

    def reserved(self) -> int:
        """Bytes every opened store sharing the directory has in flight (dead ones included
        until :meth:`reap` frees them: their files may be on disk)."""
        # only the slots below the high-water mark: a handful, not the ledger's thousand
        return sum(slot[3] for _, slot in self._slots(self._slots_used()) if slot[0])

    def alive(self, token: int) -> bool:
        """Whether the opened store ``token`` is still open in a live process (no lock: one
        read of the shared ledger)."""
        for _, (slot_token, pid, start, _, _) in self._slots(self._slots_used()):
            if slot_token == token:
                return _alive(pid, start)
        return False

    def reap(self) -> int:
        """Free the slots of stores whose process is gone; returns the bytes they held. Call
        it with the directory freshly scanned, so their files are counted as files."""
        freed = 0
        for i, (token, pid, start, reserved, _) in self._slots():
            if token and i != self._slot and not _alive(pid, start):
                _SLOT.pack_into(self._map, _SLOTS_AT + i * _SLOT.size, 0, 0, 0, 0, 0)
                freed += reserved
        self._set_slots_used()
        return freed

    def close(self) -> None:
        with self.locked():
            if self._slot >= 0:
                _SLOT.pack_into(self._map, _SLOTS_AT + self._slot * _SLOT.size, 0, 0, 0, 0, 0)
                self._slot = -1
                self._set_slots_used()
        for fd in (self._jfd, self._fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._jfd = self._fd = None
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()


def _process_start(pid: int) -> int:
    """The start time of process ``pid`` in clock ticks since boot (0 if unknown)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # the command name (field 2) may hold spaces and parentheses: fields after its last ")"
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return 0


def _alive(pid: int, start: int) -> bool:
    """Whether ``pid`` still runs the process that started at ``start`` (not a reused pid)."""
    if pid <= 0:
        return False
    now = _process_start(pid)
    if now == 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return start == 0
    return now == start
