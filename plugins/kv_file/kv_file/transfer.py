"""A request's objects moved between the caller's memory and their files: the ``file``
backend's reads and writes.

A read fills the caller's pieces from the objects' files, verified, and tells the catalog what
it learned (hits, files no record told of, files gone); a write skips what is stored, admits
the rest as one run, writes it and records it. Both run a request's objects as one native
batch (:mod:`kv_file.objbatch`) where kvcore's native I/O is on, else object by object on the
backend's threads (:mod:`kv_file.batch`, :mod:`kv_file.objio`): the same outcomes, byte for
byte.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable

import numpy as np

from kv_file import objbatch
from kv_file.admission import StoreAdmission
from kv_file.batch import READ_COUNTERS, Batches, answer
from kv_file.catalog import Catalog
from kv_file.files import ObjectFiles, fsync_dir
from kv_file.objfile import MAX_NAME_BYTES, encode_name, header_size
from kv_file.objio import DirectReads, ReadOutcome, read_object, write_object
from kv_file.paths import StoreDir, name_digest
from kv_file.stamps import Stamps
from kvcore import BlockRequest
from kvcore.fileio import FileRead
from kvcore.keys import NameRows
from kvcore.tenants import DEFAULT_TENANT

__all__ = ["Transfers"]


class Transfers:
    """Reads and writes of one opened store's objects (see the module docstring).

    :param payload: payload bytes of each part by the layout (None: no layout); an object of
        its name's part has exactly this many.
    :param sync: writes are synced (``fsync`` other than ``none``); ``sync_dirs``: their
        directories too (``data_and_dir``).
    :param io_threads: threads for I/O that waits on the disk; ``cpus``: the cores kvcore's
        threads run on (I/O that copies uses one thread per core).
    :param default_tenant: the tenant of a write whose request names none.
    """

    def __init__(
        self,
        store_dir: StoreDir,
        catalog: Catalog,
        files: ObjectFiles,
        admission: StoreAdmission,
        batches: Batches,
        direct: DirectReads,
        payload: dict[str, int] | None,
        *,
        sync: bool,
        sync_dirs: bool,
        io_threads: int,
        cpus: int,
        default_tenant: str = DEFAULT_TENANT,
    ) -> None:
        self._dir = store_dir
        self._catalog = catalog
        self._index = catalog.index
        self._files = files
        self._admission = admission
        self._batches = batches
        self._direct = direct
        self._payload = payload
        self._sync = sync
        self._sync_dirs = sync_dirs
        self._io_threads = io_threads
        self._cpus = cpus
        self._default_tenant = default_tenant  # a write's that names none
        self._stamps = Stamps(store_dir, catalog, batches, self.digest)

    def read(self, request: BlockRequest) -> int:
        """Fill the request's host buffers from the objects' files, verified; the leading run
        of blocks read (an Outcome that says why when a failure, not absence, ended it).
        Whatever the read learned goes to the catalog, also when it raises."""
        host = request.host
        assert host is not None  # the core sends host buffers to io="host" backends
        index = self._index
        hits: list[tuple[int, int]] = []  # (k, digest)
        adopted: list[tuple[int, int, bytes | None]] = []
        gone: list[int] = []

        def adopt(k: int, raw: bytes, digest: int) -> None:
            """Object ``k`` was read from a file no record told of: adopt it."""
            j = k % nparts
            expected = self._payload_bytes(request.parts[j])
            named = raw if expected in (None, host.nbytes[j]) else None
            adopted.append((digest, header_size(len(raw)) + host.nbytes[j], named))

        def settle(k: int, name: str, raw: bytes, digest: int, outcome: ReadOutcome) -> str:
            """What object ``k``'s read found, learned; its counter."""
            if outcome is ReadOutcome.OK:
                if not index.learn(name, digest):
                    adopt(k, raw, digest)
                hits.append((k, digest))
            elif outcome is ReadOutcome.MISNAMED:
                index.unname(name)
            elif outcome is not ReadOutcome.WRONG_SIZE:  # the file is gone or was removed
                gone.append(digest)
            return READ_COUNTERS[outcome]

        def settle_hits(
            ks: list[int], names: list[str], raws: list[bytes], digests: list[int]
        ) -> None:
            """:func:`settle` of read hits ``ks`` (objects of the request), in one go."""
            found = [digests[k] for k in ks]
            for at in index.learn_each([names[k] for k in ks], found):
                adopt(ks[at], raws[ks[at]], found[at])
            hits.extend(zip(ks, found, strict=True))

        def read_one(k: int) -> str:
            _, _, name, raw, digest = self._locate(request, k)
            outcome = self._read_object(request, k, raw, digest, stamps)
            return settle(k, name, raw, digest, outcome)

        nparts = len(request.parts)
        workers = self._read_workers(request)
        stamps = [0] * (request.num_blocks * nparts)  # each object's write stamp, once read
        try:
            if objbatch.enabled():
                outcomes, errors = self._read_batch(request, workers, stamps, settle, settle_hits)
            else:
                outcomes, errors = self._batches.run(
                    request, read_one, host.nbytes, workers, "io_errors"
                )
            mixed = self._stamps.refuse_mixed(request, outcomes, stamps)
            if mixed:
                hits[:] = [(k, digest) for k, digest in hits if k // nparts not in mixed]
            if index.clearing:  # a tenant being deleted: its objects are no longer served
                hits.sort()
                cut = index.withheld(digest for _, digest in hits)
                if cut is not None:
                    first = hits[cut][0] - hits[cut][0] % nparts  # its block's first object
                    outcomes[first:] = ["read_withheld"] * (len(outcomes) - first)
                    hits[:] = [(k, d) for k, d in hits if k < first]
                    self._batches.count(["read_withheld_blocks"])
        finally:  # what the read learned, for every process: after the data, off its path
            # most recently used in the request's order, whichever thread read what first
            hits.sort()
            index.touch_many([digest for _, digest in hits], time.time_ns())
            self._catalog.adopted(adopted)
            self._catalog.gone(gone)
            self._catalog.read([digest for _, digest in hits])
            self._admission.read(request, [k // nparts for k, _ in hits if k % nparts == 0])
        return answer(outcomes, errors, nparts)

    def _read_object(
        self,
        request: BlockRequest,
        k: int,
        raw: bytes,
        digest: int,
        stamps: list[int],
        *,
        native: bool = True,
    ) -> ReadOutcome:
        """Object ``k`` of a read, by :func:`read_object` (raises OSError); its write stamp
        into ``stamps[k]``."""
        i, j = divmod(k, len(request.parts))
        host = request.host
        assert host is not None
        stamp: list[int] = []
        outcome = read_object(
            self._dir.object_path(digest),
            raw,
            host.views(i, j),
            digest=digest,
            expected_len=self._payload_bytes(request.parts[j]),
            direct=self._direct,
            native=native,
            stamp=stamp,
        )
        if stamp:
            stamps[k] = stamp[0]
        return outcome

    def _read_batch(
        self,
        request: BlockRequest,
        workers: int,
        stamps: list[int],
        settle: Callable[[int, str, bytes, int, ReadOutcome], str],
        settle_hits: Callable[[list[int], list[str], list[bytes], list[int]], None],
    ) -> tuple[list[str], dict[int, OSError]]:
        """A read's objects in one native batch (see :mod:`kv_file.objbatch`); what it does
        not settle (a file that is not what its name promises) by :func:`read_object`.
        ``settle``: what one object's read found, learned (its counter); ``settle_hits``: the
        same for many read hits in one go. The objects' write stamps go into ``stamps``."""
        host = request.host
        assert host is not None
        names, raws, digests = self._locate_all(request)
        total = len(names)
        nparts = len(request.parts)
        rows, starts = host.iovecs()
        batch = objbatch.read_objects(
            self._dir.object_paths(digests),
            raws,
            list(host.nbytes) * request.num_blocks,
            objbatch.Rows(rows, starts),
            np.arange(total, dtype=np.int64) // nparts,
            deadline=request.deadline,
            direct=self._direct,
        )
        self._batches.run_native(batch, workers, sum(host.nbytes) * request.num_blocks)
        codes, errnos, direct_reads, refused = batch.results()
        stamps[:] = batch.tails().tolist()
        if refused:
            self._direct.disable(OSError(refused, os.strerror(refused)))
        self._direct.counted(direct_reads)
        ok = codes == FileRead.OK
        hit_ks = np.flatnonzero(ok).tolist()
        settle_hits(hit_ks, names, raws, digests)
        outcomes = ["skipped"] * total
        for k in hit_ks:
            outcomes[k] = READ_COUNTERS[ReadOutcome.OK]
        errors: dict[int, OSError] = {}
        for k in np.flatnonzero(~ok).tolist():
            code = int(codes[k])
            if code == FileRead.SKIPPED:
                continue
            if code == FileRead.MISSING:
                outcomes[k] = settle(k, names[k], raws[k], digests[k], ReadOutcome.MISSING)
            elif code == FileRead.DEADLINE:
                outcomes[k] = "deadline"
            else:
                try:
                    if code == FileRead.ERRNO:
                        err = int(errnos[k])
                        raise OSError(err, os.strerror(err), self._dir.object_path(digests[k]))
                    # not what its name promises (or direct reads refused): looked at again
                    outcome = self._read_object(
                        request, k, raws[k], digests[k], stamps, native=False
                    )
                except OSError as exc:
                    errors[k] = exc
                    outcomes[k] = "io_errors"
                    self._batches.failed("io_errors", exc, names[k])
                    continue
                outcomes[k] = settle(k, names[k], raws[k], digests[k], outcome)
        self._batches.count(outcomes)
        return outcomes, errors

    def write(self, request: BlockRequest) -> int:
        """Objects already on disk are skipped (and pinned, so this write cannot evict what
        it acknowledges); the others' bytes are reserved in order, as one run: when the batch
        does not fit, the leading run that fits is stored and acknowledged, the rest refused.
        Every part of a block carries the block's write stamp (:mod:`kv_file.stamps`).

        What is already stored is what the catalog knows, caught up with every process's
        records first, and confirmed by an ``lstat``; an object no record tells of is written
        without a look (a file in its place that no record tells of, a copy another process
        is writing now or a crash left, is replaced by the same bytes).
        """
        self._catalog.sync()
        tenant = request.tenant or self._default_tenant
        if tenant in self._index.clearing:  # being deleted: nothing of it is stored
            self._batches.count(["write_refused_tenant_clearing"] * request.num_blocks)
            return 0
        host = request.host
        assert host is not None  # the core sends host buffers to io="host" backends
        index = self._index
        catalog = self._catalog
        planned: dict[int, tuple[bytes, int, int, bytes | None]] = {}
        before: list[str | None] = [None] * (request.num_blocks * len(request.parts))
        pinned: list[int] = []  # acknowledged objects: evictions pass them over until we return
        written_dirs: dict[str, list[int]] = {}
        _, raws, digests = self._locate_all(request)
        nparts = len(request.parts)
        # named only as an object of its part's size (the core checks buffers against the
        # layout; this keeps any other object from ever being counted by its name)
        counted = [
            self._payload_bytes(p) in (None, host.nbytes[j]) for j, p in enumerate(request.parts)
        ]
        indexed = index.size_of
        for k, (raw, digest) in enumerate(zip(raws, digests, strict=True)):
            j = k % nparts
            if j == 0 and request.expired():
                before[k] = "deadline"
                break
            size = header_size(len(raw)) + host.nbytes[j]
            named = raw if counted[j] else None
            if indexed(digest) is not None and self._files.hold_stored(digest, named, size):
                pinned.append(digest)
                before[k] = "write_skipped"  # names are content-derived: same name, same bytes
            else:
                planned[k] = (raw, digest, size, named)
        order = list(planned)
        # Synced writes wait on the disk; unsynced ones are copies into the page cache.
        workers = self._io_threads if self._sync else min(self._io_threads, self._cpus)
        # skipped objects are being stored again: most recently used, for every process
        admitted = catalog.admit(
            [planned[k][2] for k in order],
            touched=pinned,
            deadline=request.deadline,
            tenant=tenant,
        )
        for k in order[admitted:]:
            before[k] = "write_refused"
            del planned[k]
        reserved = dict(planned)  # reservations not yet turned into files or given back
        native = objbatch.enabled() and all(len(p[0]) <= MAX_NAME_BYTES for p in planned.values())
        # each block's write stamp, from its parts' checksums: computed in the native batch as
        # it writes (one pass over the bytes) when it writes whole blocks unsynced, else first
        # (a synced write hashes before it writes anyway)
        in_batch = native and not self._sync and self._stamps.whole_blocks(request, planned)
        sums, stamps = ({}, []) if in_batch else self._stamps.for_write(request, planned, workers)
        written: list[tuple[int, int, int, bytes | None]] = []  # k, digest, size, name

        def stored(k: int) -> str:
            """Object ``k``'s file is in place."""
            _, digest, size, named = reserved.pop(k)
            written.append((k, digest, size, named))  # recorded with the rest, in one go
            if self._sync_dirs:
                written_dirs.setdefault(self._dir.subdir(digest), []).append(k)
            return "write_stored"

        def failed(k: int, exc: OSError) -> None:
            """Object ``k``'s write failed (its temp file is gone). When its rename met a
            directory in its place (a write does not look before it writes an object no
            record tells of), that is removed: the next write of it lands."""
            _, digest, size, _ = reserved.pop(k)
            catalog.release(size)
            if exc.errno in (errno.EISDIR, errno.ENOTEMPTY):
                self._files.look(digest, None)

        def write_one(k: int) -> str:
            if k not in planned:
                return before[k] or "deadline"
            raw, digest, _, _ = planned[k]
            i, j = divmod(k, len(request.parts))
            try:
                write_object(
                    self._dir.object_path(digest),
                    self._dir.temp_path(digest),
                    raw,
                    host.views(i, j),
                    sync=self._sync,
                    meta=None if request.block_meta is None else request.block_meta[i],
                    stamp=stamps[i],
                    checksum=sums[k],
                )
            except OSError as exc:
                failed(k, exc)
                raise
            return stored(k)

        # the names' blocks as the request knows them: the index need not parse the names
        rows = request.object_names
        try:
            # the records about these objects, from before their renames to their own record
            with catalog.watch_writes(planned[k][1] for k in planned) as watch:
                try:
                    if native:
                        stamped = None if in_batch else (sums, stamps)
                        outcomes, errors = self._write_batch(
                            request, planned, stamped, before, workers, stored, failed
                        )
                    else:
                        outcomes, errors = self._batches.run(
                            request, write_one, host.nbytes, workers, "write_errors"
                        )
                finally:  # every file in place becomes a file of the store, also on a failure
                    # recorded in the request's order (the LRU order then does not depend on
                    # which thread finished first)
                    written.sort(key=lambda w: w[0])
                    blocks = rows.blocks() if isinstance(rows, NameRows) else None
                    lost = catalog.stored(
                        [(d, size, n) for _, d, size, n in written],
                        watch,
                        None
                        if blocks is None
                        else {d: blocks[k // nparts] for k, d, _, _ in written},
                        tenant,
                    )
            for k, digest, _, _ in written:
                if digest in lost:
                    outcomes[k] = "write_refused"  # evicted by another process meanwhile
                else:
                    pinned.append(digest)
            for d, ks in written_dirs.items():  # one directory fsync per batch, not per object
                try:
                    fsync_dir(d)
                except OSError as exc:
                    for k in ks:
                        outcomes[k], errors[k] = "write_errors", exc
        finally:
            unused = sum(size for _, _, size, _ in reserved.values())  # stopped before written
            if unused:
                catalog.release(unused)
            index.unpin(pinned)
        return answer(outcomes, errors, len(request.parts))

    def _write_batch(
        self,
        request: BlockRequest,
        planned: dict[int, tuple[bytes, int, int, bytes | None]],
        stamped: tuple[dict[int, bytes], list[int]] | None,
        before: list[str | None],
        workers: int,
        stored: Callable[[int], str],
        failed: Callable[[int, OSError], None],
    ) -> tuple[list[str], dict[int, OSError]]:
        """A write's planned objects (``k`` -> encoded name, digest, size, name if counted)
        in one native batch (see :mod:`kv_file.objbatch`); ``stamped``: their checksums
        (``k`` -> 16 bytes) and their blocks' stamps, or None for the batch to compute them
        (whole blocks); the others' outcomes are
        ``before``'s. ``stored(k)`` / ``failed(k, error)``: object ``k``'s file is in place /
        its write failed."""
        host = request.host
        assert host is not None
        nparts = len(request.parts)
        ks = list(planned)
        objects = np.fromiter(ks, dtype=np.int64, count=len(ks))
        rows, starts = host.iovecs()
        metas = request.block_meta
        digests = [planned[k][1] for k in ks]
        batch = objbatch.write_objects(
            self._dir.temp_paths(digests),
            self._dir.object_paths(digests),
            [planned[k][0] for k in ks],
            [host.nbytes[k % nparts] for k in ks],
            [None] * len(ks) if metas is None else [metas[k // nparts] for k in ks],
            None
            if stamped is None
            else ([stamped[0][k] for k in ks], [stamped[1][k // nparts] for k in ks]),
            objbatch.Rows(rows, starts).take(objects),
            objects // nparts,
            deadline=request.deadline,
            sync=self._sync,
        )
        self._batches.run_native(batch, workers, sum(planned[k][2] for k in ks))
        codes, errnos, _, _ = batch.results()
        outcomes = [o if o is not None else "skipped" for o in before]
        errors: dict[int, OSError] = {}
        for k, code, err in zip(ks, codes.tolist(), errnos.tolist(), strict=True):
            if code == FileRead.OK:
                outcomes[k] = stored(k)
            elif code == FileRead.DEADLINE:
                outcomes[k] = "deadline"
            elif code == FileRead.ERRNO:
                exc = OSError(err, os.strerror(err), self._dir.object_path(planned[k][1]))
                failed(k, exc)
                errors[k] = exc
                outcomes[k] = "write_errors"
                self._batches.failed(
                    "write_errors", exc, request.object_names[k // nparts][k % nparts]
                )
        self._batches.count(outcomes)
        return outcomes, errors

    def _locate_all(self, request: BlockRequest) -> tuple[list[str], list[bytes], list[int]]:
        """Every object of a request (flat ``[block][part]`` order): names, encoded names,
        file digests."""
        names = [name for block in request.object_names for name in block]
        raws = [encode_name(name) for name in names]
        known = self._index.by_name.get
        digests = [
            d if (d := known(name)) is not None else name_digest(raw)
            for name, raw in zip(names, raws, strict=True)
        ]
        return names, raws, digests

    def _locate(self, request: BlockRequest, k: int) -> tuple[int, int, str, bytes, int]:
        """Object ``k`` of a request (flat ``[block][part]`` order): its block and part
        index, name, encoded name and file digest."""
        i, j = divmod(k, len(request.parts))
        name = request.object_names[i][j]
        raw = encode_name(name)
        return i, j, name, raw, self.digest(name, raw)

    def _payload_bytes(self, part: str) -> int | None:
        """Bytes an object of ``part`` holds by the layout (None: no layout, or no such part)."""
        return None if self._payload is None else self._payload.get(part)

    def digest(self, name: str, raw: bytes | None = None) -> int:
        """The file digest of ``name``: from the index when learned, else hashed."""
        digest = self._index.by_name.get(name)
        return digest if digest is not None else name_digest(raw or encode_name(name))

    def _read_workers(self, request: BlockRequest) -> int:
        """Threads for a read: all ``io_threads`` when it goes to the disk (each one mostly
        waits on a direct read), one per core when the page cache holds it (each one copies,
        and more threads than cores measured slower). The batch's first object decides."""
        if not self._direct.enabled or request.num_blocks == 0:
            return min(self._io_threads, self._cpus)
        name = request.object_names[0][0]
        if self._direct.path_cached(self._dir.object_path(self.digest(name))):
            return min(self._io_threads, self._cpus)
        return self._io_threads
