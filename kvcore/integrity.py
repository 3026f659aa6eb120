"""Block digests: what an opened backend that keeps no checksums stores beside each block.

A backend that returns whatever bytes it holds (an in-memory store, Mooncake, a vendor cache)
would hand a corrupted object to the engine as KV, and the engine would compute wrong tokens
from it. So the facade of such a backend (:class:`kvcore.Backend`, opened with
``verify_blocks="auto"``, the default) keeps an xxh3-128 digest of every object it stores
and checks every object it reads, whoever calls it: the transfer manager, an engine adapter,
a tier stack, the CLI. Backends that verify what they return (``Capabilities.checksums``:
kv_file) get none of this unless ``verify_blocks="always"``.

Two layouts, chosen per request by its names:

- names kvcore built (:meth:`kvcore.Backend.request`: ``{namespace}/{key}/{part}{scope}``):
  one digest object per block, part :data:`DIGEST_PART` in the same scope, holding the digest
  of each part in part order (``16 * len(parts)`` bytes);
- any other names (an engine's own, FastDeploy's say, or another namespace's): one 16-byte
  digest object per object, named ``{name}{FOREIGN_SUFFIX}``. So an object read alone is
  checked against its own digest, and no name is ever guessed.

The digests' own calls are counted apart (``write_digests``, ``read_digests``,
``remove_digests``), so ``blocks_done.write`` still counts the blocks a caller wrote. A write
stores the digests, then the data (small objects first: a store that fills up takes them
whenever it takes any data); a block counts as stored only when both are, and a crash or a
short write between leaves a digest whose block no query finds (never removed by the write:
see :meth:`BlockDigests.write`). A read reads the digests, then
the data, and checks the bytes that arrived before the caller sees a count: the first block whose bytes differ from its
digest ends the leading run, is removed from the store (data and digest, as a REMOVED
event) and is counted (``corrupt_blocks.read``); the outcome's kind is
:attr:`~kvcore.FailureKind.CORRUPT`.

A read made in spans (a paced load: one call per span, so that a load falling behind is cut
between two) reads the digests of all its blocks once, at its start
(:meth:`BlockDigests.read_once`), instead of once per span: each digest read is a round trip,
and at 4 Gbit/s the per-span ones were two thirds of what reading 125 blocks in 24 spans cost
beyond one call.

.. versionadded:: 0.3 (0.2 kept digests in ``kvcore.transfer.integrity.VerifiedBlocks``,
   which each caller wrapped around its backend by hand; that name is still importable for
   one release)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import xxhash

from kvcore.keys import NameRows, ObjectName, name_columns, object_names
from kvcore.metrics import Metrics, OnceLogger
from kvcore.requests import BlockRequest, FailureKind, HostBuffers, Outcome

__all__ = ["DIGEST_BYTES", "DIGEST_PART", "FOREIGN_SUFFIX", "BlockDigests", "PlainCalls"]

log = logging.getLogger("kvcore.integrity")

#: the part name of a block's digest object (names kvcore built)
DIGEST_PART = "sum"
#: what an object name kvcore did not build gets appended for its digest object's name
FOREIGN_SUFFIX = "#xxh3-128"
#: bytes of one object's digest (xxh3-128)
DIGEST_BYTES = 16


class PlainCalls(Protocol):
    """The unverified calls of an opened backend (what :class:`BlockDigests` builds on)."""

    def query(self, request: BlockRequest, op: str = ...) -> Outcome: ...
    def read(self, request: BlockRequest, op: str = ...) -> Outcome: ...
    def write(self, request: BlockRequest, op: str = ...) -> Outcome: ...
    def remove(self, request: BlockRequest, op: str = ...) -> Outcome: ...


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a request's digests live: the request naming them, and bytes per block."""

    names: Sequence[tuple[str, ...]]
    parts: tuple[str, ...]
    part_nbytes: tuple[int, ...]

    @property
    def block_nbytes(self) -> int:
        return sum(self.part_nbytes)


@dataclass(slots=True)
class _HeldDigests:
    """The digests of a read's blocks, read once at its start (:meth:`BlockDigests.read_once`):
    each block's digest-object names (a row) to its digest bytes, None for a block that had
    none then. Digest names are content-derived, so a digest read a moment earlier is the one
    the block's bytes must match; a block rewritten since is caught as corrupt, never served."""

    sums: dict[tuple[str, ...], bytes | None] = field(default_factory=dict)
    #: the digest read's own answer: what a span reports for a block that had no digest
    answer: Outcome = field(default_factory=lambda: Outcome(0))

    def leading(self, names: Sequence[tuple[str, ...]], n: int) -> list[bytes] | None:
        """The held digests of the leading blocks of a span named ``names`` that had one;
        None when a block of it is not one of this read's (it reads its digests as usual)."""
        rows = [tuple(names[i]) for i in range(n)]
        if any(row not in self.sums for row in rows):
            return None
        out: list[bytes] = []
        for row in rows:
            got = self.sums[row]
            if got is None:
                break
            out.append(got)
        return out


class BlockDigests:
    """Digest objects beside the blocks of one opened backend.

    :param namespace: the backend's namespace (names kvcore built start with it).
    :param plain: the backend's unverified calls.
    :param remove_corrupt: removes a corrupt block (data and digests) the way a caller's
        remove would, events included; None when the backend cannot remove.
    """

    def __init__(
        self,
        name: str,
        namespace: str,
        plain: PlainCalls,
        metrics: Metrics,
        remove_corrupt: Callable[[BlockRequest], object] | None,
    ) -> None:
        self.name = name
        self._namespace = namespace
        self._plain = plain
        self._metrics = metrics
        self._remove_corrupt = remove_corrupt
        self._can_remove = remove_corrupt is not None
        self._warn = OnceLogger(log)
        #: digests read once for a read in spans, by task id (:meth:`read_once`)
        self._held: dict[str, _HeldDigests] = {}
        self._held_lock = threading.Lock()

    # -- where the digests of a request live -------------------------------------------------

    def _layout(self, request: BlockRequest) -> _Layout:
        n = request.num_blocks
        parts = len(request.parts)
        kvcore_names = self._kvcore_digest_names(request)
        if kvcore_names is not None:
            return _Layout(kvcore_names, (DIGEST_PART,), (DIGEST_BYTES * parts,))
        columns = [
            [name + FOREIGN_SUFFIX for name in column]
            for column in name_columns(request.object_names, parts)
        ]
        return _Layout(
            NameRows(columns, n),
            tuple(p + FOREIGN_SUFFIX for p in request.parts),
            (DIGEST_BYTES,) * parts,
        )

    def _kvcore_digest_names(self, request: BlockRequest) -> NameRows | None:
        """The per-block digest names when every block's objects are named as
        :meth:`kvcore.Backend.request` names them, in this namespace and one scope (a weight
        version changed since must not split a block from its digest); else None."""
        names = request.object_names
        if isinstance(names, NameRows) and names.typed:  # the identity came with the names
            first = names.identity(0, 0) if len(names) else None
            if first is None or first.namespace != self._namespace:
                return None
            return names.with_parts((DIGEST_PART,))
        # plain rows (a request built by other code): kvcore's names only if every first
        # object's name is exactly the one kvcore would build
        keys = request.block_keys
        if not keys or len(keys) != request.num_blocks:
            return None
        first_column = name_columns(names, 1)[0]
        first = ObjectName.parse(first_column[0])
        if (
            first is None
            or first.namespace != self._namespace
            or first.block_key != keys[0]
            or first.part != request.parts[0]
        ):
            return None

        expected = object_names(
            keys,
            request.parts[:1],
            namespace=self._namespace,
            rank=first.rank,
            world_size=first.world_size,
            weight_version=first.weight_version,
        )
        if expected.column(0) != list(first_column):
            return None
        return expected.with_parts((DIGEST_PART,))

    def _request(
        self, request: BlockRequest, layout: _Layout, host: HostBuffers | None = None
    ) -> BlockRequest:
        return BlockRequest(
            task_id=request.task_id,
            block_keys=request.block_keys,
            object_names=layout.names,
            parts=layout.parts,
            deadline=request.deadline,
            start_block=request.start_block,
            host=host,
            num_blocks=request.num_blocks,
            part_nbytes=layout.part_nbytes,
            caller_idle=request.caller_idle,  # the digests are read as the data is
        )

    @staticmethod
    def is_digest(name: str, identity: ObjectName | None) -> bool:
        """Whether ``name`` (of identity ``identity``) names a digest object (of either
        layout)."""
        if identity is not None:
            return identity.part == DIGEST_PART
        return name.endswith(FOREIGN_SUFFIX)

    def digests_of(self, request: BlockRequest) -> BlockRequest:
        """The request naming the digest objects of ``request``'s blocks (no buffers)."""
        return self._request(request, self._layout(request))

    def _buffers(
        self, request: BlockRequest, layout: _Layout, n: int
    ) -> tuple[np.ndarray, BlockRequest]:
        """A buffer for the digests of the first ``n`` blocks, and the request that stores
        them from it or reads them into it."""
        size = layout.block_nbytes
        buf = np.empty(n * size, dtype=np.uint8)
        base = buf.ctypes.data
        offsets = np.cumsum((0, *layout.part_nbytes[:-1])).tolist()
        host = HostBuffers(
            ptrs=tuple(tuple(base + i * size + o for o in offsets) for i in range(n)),
            nbytes=layout.part_nbytes,
        )
        sliced = replace(layout, names=layout.names[:n])
        return buf, self._request(request.slice(0, n), sliced, host=host)

    @staticmethod
    def digest(host: HostBuffers, block: int) -> bytes:
        """One block's digests: xxh3-128 of each part, in part order."""
        out = []
        for part in range(len(host.nbytes)):
            h = xxhash.xxh3_128()
            for view in host.views(block, part):
                h.update(view)
            out.append(h.digest())
        return b"".join(out)

    # -- the verified calls ------------------------------------------------------------------

    def query(self, request: BlockRequest) -> Outcome:
        """Leading blocks whose objects and digests are all stored: one query, the digests
        asked as more parts of each block (a query needs names, no buffers)."""
        if request.num_blocks == 0:
            return self._plain.query(request)
        return self._plain.query(self.with_digests(request))

    def with_digests(self, request: BlockRequest) -> BlockRequest:
        """``request`` without buffers, each block's digests as more parts: what presence is
        asked with (a block counts only with its digest)."""
        layout = self._layout(request)
        parts = len(request.parts)
        names = NameRows(
            [
                *name_columns(request.object_names, parts),
                *name_columns(layout.names, len(layout.parts)),
            ],
            request.num_blocks,
        )
        sizes = request.part_nbytes
        return replace(
            request,
            object_names=names,
            parts=(*request.parts, *layout.parts),
            host=None,
            part_nbytes=None if sizes is None else (*sizes, *layout.part_nbytes),
        )

    def write(self, request: BlockRequest) -> Outcome:
        """Store the digests, then the objects of the blocks whose digests landed; a block
        counts with both. Digests go first because they are small: a store that fills up
        takes them whenever it takes any data.

        A write that stops short removes nothing. Names are content-derived, so an object it
        finds stored, a digest above all, may belong to a block that another write (a thread
        of this process, another process, a tier stack's hand-down) stored whole and reported
        as stored; removing it would make that block unreadable while its writer counts it as
        kept (a stack would then hold it in no tier). A digest whose data never landed is
        left for the next write of the block (same name, same digest) or for the store's own
        eviction: 16 bytes per part, never served alone (a query needs the data too).

        .. versionchanged:: 0.3
           digests of blocks whose data did not land, and the blocks a full store evicted
           while they were written, are no longer removed (``remove_unverified``)."""
        n = request.num_blocks
        if n == 0:
            return self._plain.write(request)
        assert request.host is not None
        layout = self._layout(request)
        buf, sums = self._buffers(request, layout, n)
        buf[:] = np.frombuffer(b"".join(self.digest(request.host, i) for i in range(n)), np.uint8)
        digests = self._plain.write(sums, op="write_digests")
        d = int(digests)
        if d == 0:
            return digests
        data = self._plain.write(_leading(request, d))
        m = int(data)
        if m and (m < n or data.failure is not None):
            # a short write means a full store, and a store that evicts to make room may have
            # evicted this very write's digests for its data (Mooncake does): acknowledge only
            # what is there now
            found = int(self.query(request.slice(0, m)))
            if found < m:
                why = data.failure or digests.failure or "store full"
                return Outcome(found, f"{why}; {m - found} blocks evicted while written")
        return data if m < d or d == n else digests

    def read(self, request: BlockRequest) -> Outcome:
        """Read the digests, then the objects of the blocks that have one; count the leading
        blocks whose bytes match their digest. Digests first: they are small, a block without
        one costs no data read, and a deadline that passes during the data read leaves the
        digests of what was read at hand. Within :meth:`read_once` of a request of the same
        task, the digests of its blocks are the ones read then."""
        n = request.num_blocks
        if n == 0:
            return self._plain.read(request)
        assert request.host is not None
        layout = self._layout(request)
        held = self._held.get(request.task_id)
        expected = None if held is None else held.leading(layout.names, n)
        if expected is not None and held is not None:
            digests = held.answer if len(expected) < n else Outcome(n)
        else:
            size = layout.block_nbytes
            buf, sums = self._buffers(request, layout, n)
            digests = self._plain.read(sums, op="read_digests")
            expected = [buf[i * size : (i + 1) * size].tobytes() for i in range(int(digests))]
        d = len(expected)
        if d == 0:
            return Outcome(0, digests.failure, digests.kind)
        data = self._plain.read(_leading(request, d))
        for i in range(int(data)):
            if self.digest(request.host, i) != expected[i]:
                return self._corrupt(request, i)
        if int(data) < d or d == n:
            return data
        return Outcome(d, digests.failure, digests.kind)

    @contextmanager
    def read_once(self, request: BlockRequest) -> Iterator[None]:
        """Within: reads of ``request``'s blocks (its task's requests, sliced from it, on any
        thread) check them against digests read once, now, for all of its blocks, rather
        than each reading its own. For a read made in spans; a block that had no digest now
        ends a span's run as it would have then. A scope of a task already in one adds
        nothing (the outer scope's digests serve)."""
        n = request.num_blocks
        with self._held_lock:
            nested = request.task_id in self._held
        if n <= 0 or nested:
            yield
            return
        layout = self._layout(request)
        size = layout.block_nbytes
        buf, sums = self._buffers(request, layout, n)
        answer = self._plain.read(sums, op="read_digests")
        held = _HeldDigests(answer=answer)
        for i in range(n):
            row = tuple(layout.names[i])
            held.sums[row] = buf[i * size : (i + 1) * size].tobytes() if i < answer else None
        with self._held_lock:
            self._held[request.task_id] = held
        try:
            yield
        finally:
            with self._held_lock:
                self._held.pop(request.task_id, None)

    def remove(self, request: BlockRequest) -> Outcome:
        removed = self._plain.remove(request)
        self.remove_digests(request)
        return removed

    def remove_digests(self, request: BlockRequest) -> None:
        """Remove the digests of ``request``'s blocks (after their objects were removed)."""
        if request.num_blocks:
            self._plain.remove(self.digests_of(request), op="remove_digests")

    def _corrupt(self, request: BlockRequest, i: int) -> Outcome:
        block = request.start_block + i
        if self._remove_corrupt is not None:
            self._remove_corrupt(request.slice(i, i + 1))
            why = f"block {block} differs from its digest (removed from the store)"
        else:
            why = f"block {block} differs from its digest"
        self._metrics.add("read", corrupt_blocks=1)
        self._warn.warning(
            ("corrupt", self.name),
            "kvcore: backend %r returned corrupt bytes for task %r: %s; further corrupt "
            "blocks are logged at debug level",
            self.name,
            request.task_id,
            why,
        )
        return Outcome(i, why, FailureKind.CORRUPT)


def _leading(request: BlockRequest, n: int) -> BlockRequest:
    """The first ``n`` blocks of ``request`` (the request itself when that is all of it)."""
    if n >= request.num_blocks:
        return request
    host = request.host.slice(0, n) if request.host is not None else None
    return request.slice(0, n, host=host)
