"""Block digests for backends that keep no checksum of their own.

A backend that returns whatever bytes it holds (an in-memory store, Mooncake, a vendor cache)
would hand a corrupted object to the engine as KV, and the engine would compute wrong tokens
from it. When such a backend is used through the transfer manager, :class:`VerifiedBlocks`
stores beside each block one small object (part ``sum``): the xxh3-128 digest of each of the
block's parts. A write stores the parts, then the digests; a block counts as stored only when
both are. A read reads both and checks the bytes that arrived (in staging, or in the engine's
own host blocks) before anything uses them: the first block whose bytes differ from its digest
ends the leading run, is removed from the store, and the task reports a ``backend_error``.
Backends that verify what they return (``Capabilities.checksums``, kv_file) skip all of this.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import xxhash

from kvcore.backend import Backend
from kvcore.keys import NameRows, name_columns, names_in_scope
from kvcore.metrics import OnceLogger
from kvcore.requests import BlockRequest, HostBuffers, Outcome

__all__ = ["DIGEST_PART", "VerifiedBlocks"]

log = logging.getLogger("kvcore.transfer")

#: the part name of a block's digest object
DIGEST_PART = "sum"
_DIGEST_BYTES = 16  # xxh3-128 per part


class VerifiedBlocks:
    """``query``, ``read`` and ``write`` of a backend, with a digest object beside each block."""

    def __init__(self, backend: Backend, parts: int) -> None:
        self.backend = backend
        self.name = backend.name
        self.size = _DIGEST_BYTES * parts
        self._warn = OnceLogger(log)

    def _digest_names(self, request: BlockRequest) -> NameRows:
        """The names of the blocks' digest objects (one part), in the scope the request's own
        names were built in (a weight version changed since must not split a block from its
        digest). The request has at least one block."""
        namespace = self.backend.context.namespace
        prefix = f"{namespace}/{request.block_keys[0]}/{request.parts[0]}"
        first = request.object_names[0][0]
        assert first.startswith(prefix), "names not built by Backend.request"
        scope = first[len(prefix) :]
        return names_in_scope(request.block_keys, (DIGEST_PART,), namespace=namespace, scope=scope)

    def _digests(self, request: BlockRequest, host: HostBuffers | None = None) -> BlockRequest:
        """The request of the blocks' digest objects (see :meth:`_digest_names`)."""
        return BlockRequest(
            task_id=request.task_id,
            block_keys=request.block_keys,
            object_names=self._digest_names(request) if request.num_blocks else (),
            parts=(DIGEST_PART,),
            deadline=request.deadline,
            start_block=request.start_block,
            token_ids=request.token_ids,
            host=host,
            part_nbytes=(self.size,),
        )

    def digests_of(self, request: BlockRequest) -> BlockRequest:
        """The request naming the digest objects of ``request``'s blocks (to remove them with
        the blocks).

        .. versionadded:: 0.3
        """
        return self._digests(request)

    def _digest_buffers(self, request: BlockRequest, n: int) -> tuple[np.ndarray, BlockRequest]:
        """A buffer for the digests of the first ``n`` blocks of ``request`` (exactly ``n``
        digests long), and the request that stores them from it or reads them into it."""
        buf = np.empty(n * self.size, dtype=np.uint8)
        base = buf.ctypes.data
        host = HostBuffers(
            ptrs=tuple((base + i * self.size,) for i in range(n)), nbytes=(self.size,)
        )
        return buf, self._digests(request.slice(0, n), host=host)

    @staticmethod
    def digest(host: HostBuffers, block: int) -> bytes:
        """The digest object of one block: xxh3-128 of each part, in part order."""
        out = []
        for part in range(len(host.nbytes)):
            h = xxhash.xxh3_128()
            for view in host.views(block, part):
                h.update(view)
            out.append(h.digest())
        return b"".join(out)

    def query(self, request: BlockRequest) -> Outcome:
        """Leading blocks whose parts and digest are all stored: one query of the backend,
        the digest asked as one more part of each block (a query needs names, no buffers)."""
        if request.num_blocks == 0:
            return self.backend.query(request)
        parts = len(request.parts)
        names = NameRows(
            [*name_columns(request.object_names, parts), self._digest_names(request).column(0)],
            request.num_blocks,
        )
        sizes = request.part_nbytes
        return self.backend.query(
            replace(
                request,
                object_names=names,
                parts=(*request.parts, DIGEST_PART),
                host=None,
                part_nbytes=None if sizes is None else (*sizes, self.size),
            )
        )

    def write(self, request: BlockRequest) -> Outcome:
        """Store the parts, then the digests of the blocks stored; a block counts with both."""
        return _with_digests(self.backend.write(request), lambda n: self._store_digests(request, n))

    def read(self, request: BlockRequest) -> Outcome:
        """Read the parts and the digests; count the leading blocks whose bytes match."""
        return _with_digests(self.backend.read(request), lambda n: self._check_digests(request, n))

    def _store_digests(self, request: BlockRequest, n: int) -> Outcome:
        assert request.host is not None
        digests = b"".join(self.digest(request.host, i) for i in range(n))
        buf, sums_request = self._digest_buffers(request, n)
        buf[:] = np.frombuffer(digests, dtype=np.uint8)
        return self.backend.write(sums_request)

    def _check_digests(self, request: BlockRequest, n: int) -> Outcome:
        """Read the digests of the first ``n`` blocks read; the first block that differs from
        its digest ends the run (and is removed)."""
        assert request.host is not None
        buf, sums_request = self._digest_buffers(request, n)
        sums = self.backend.read(sums_request)
        for i in range(min(n, int(sums))):
            if self.digest(request.host, i) != buf[i * self.size : (i + 1) * self.size].tobytes():
                return self._corrupt(request, i)
        return sums

    def _corrupt(self, request: BlockRequest, i: int) -> Outcome:
        block = request.start_block + i
        bad = request.slice(i, i + 1)
        if self.backend.implements("kvcore_remove"):
            self.backend.remove(bad)
            self.backend.remove(self._digests(bad))
        self.backend.metrics.add("read", corrupt_blocks=1)
        why = f"block {block} differs from its digest (removed from the store)"
        self._warn.warning(
            ("corrupt", self.name),
            "kvcore: backend %r returned corrupt bytes for task %r: %s; further corrupt "
            "blocks are logged at debug level",
            self.name,
            request.task_id,
            why,
        )
        return Outcome(i, why)

    def remove(self, request: BlockRequest) -> Outcome:
        removed = self.backend.remove(request)
        self.backend.remove(self._digests(request))
        return removed

    def implements(self, hook: str) -> bool:
        return self.backend.implements(hook)


def _with_digests(data: Outcome, digests: Callable[[int], Outcome]) -> Outcome:
    """Blocks that count: ``data`` is what the backend did with the blocks' parts, and
    ``digests(n)`` does the same for the digests of the first ``n`` of them. The shorter
    outcome wins, so a block counts only when both hold (and a failure is kept)."""
    if data == 0:
        return data
    sums = digests(int(data))
    return sums if sums < data else data
