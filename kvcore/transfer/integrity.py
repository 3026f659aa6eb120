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

import numpy as np
import xxhash

from kvcore.backend import Backend
from kvcore.keys import NameRows, names_in_scope
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

    def _digests(self, request: BlockRequest, host: HostBuffers | None = None) -> BlockRequest:
        """The request of the blocks' digest objects, named in the scope the request's own
        names were built in (a weight version changed since must not split a block from its
        digest)."""
        names: NameRows | tuple = ()
        if request.num_blocks:
            namespace = self.backend.context.namespace
            prefix = f"{namespace}/{request.block_keys[0]}/{request.parts[0]}"
            first = request.object_names[0][0]
            assert first.startswith(prefix), "names not built by Backend.request"
            scope = first[len(prefix) :]
            names = names_in_scope(
                request.block_keys, (DIGEST_PART,), namespace=namespace, scope=scope
            )
        return BlockRequest(
            task_id=request.task_id,
            block_keys=request.block_keys,
            object_names=names,
            parts=(DIGEST_PART,),
            deadline=request.deadline,
            start_block=request.start_block,
            token_ids=request.token_ids,
            host=host,
            part_nbytes=(self.size,),
        )

    def _buffer(self, n: int) -> tuple[np.ndarray, HostBuffers]:
        buf = np.empty(max(n, 1) * self.size, dtype=np.uint8)
        base = buf.ctypes.data
        ptrs = tuple((base + i * self.size,) for i in range(n))
        return buf, HostBuffers(ptrs=ptrs, nbytes=(self.size,))

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
        """Leading blocks whose parts and digest are all stored."""
        data = self.backend.query(request)
        if data == 0:
            return data
        sums = self.backend.query(self._digests(request.slice(0, data)))
        return sums if sums < data else data

    def write(self, request: BlockRequest) -> Outcome:
        """Store the parts, then the digests of the blocks stored; a block counts with both."""
        got = self.backend.write(request)
        if got == 0:
            return got
        assert request.host is not None
        buf, host = self._buffer(got)
        for i in range(got):
            buf[i * self.size : (i + 1) * self.size] = np.frombuffer(
                self.digest(request.host, i), dtype=np.uint8
            )
        sums = self.backend.write(self._digests(request.slice(0, got), host=host))
        return sums if sums < got else got

    def read(self, request: BlockRequest) -> Outcome:
        """Read the parts and the digests; count the leading blocks whose bytes match."""
        got = self.backend.read(request)
        if got == 0:
            return got
        assert request.host is not None
        buf, host = self._buffer(got)
        sums = self.backend.read(self._digests(request.slice(0, got), host=host))
        n = min(int(got), int(sums))
        for i in range(n):
            if self.digest(request.host, i) != buf[i * self.size : (i + 1) * self.size].tobytes():
                return self._corrupt(request, i)
        if sums < got:
            return sums
        return got

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
