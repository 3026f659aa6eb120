"""What a full store takes: the backend's side of :mod:`kvcore.admission`.

The policy itself is the core's; this holds one for a store directory and feeds it: a block
is known to the policy by :func:`kvcore.admission.block_id` of its key (so a simulation of
the store decides as it does), the store's capacity in blocks
follows from the size of a block's files, and the room left (blocks that fit before anything
is evicted) from the bytes the catalog counts. Blocks already stored are admitted without an
offer (and count as references the policy sees, as read hits do).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from kv_file.index import Index
from kv_file.objfile import encode_name, header_size
from kvcore import BlockRequest
from kvcore.admission import PolicyName, block_id, make_policy

__all__ = ["StoreAdmission"]


class StoreAdmission:
    """One store's admission policy, sized from the store (see the module docstring).

    :param payload: payload bytes of each part by the layout (None: no layout; the capacity
        in blocks is then learned from the objects indexed).
    :param reserved: bytes reserved by writes in flight, in every process.
    :param own_files: bytes the store's own files count against its capacity (the journal and
        ledger: see ``Catalog``); the room and the policy's size are of the rest.
    """

    def __init__(
        self,
        policy: PolicyName,
        index: Index,
        payload: dict[str, int] | None,
        reserved: Callable[[], int],
        own_files: Callable[[], int],
        *,
        doorkeeper_factor: float,
        sample_rate: float,
    ) -> None:
        self._index = index
        self._payload = payload
        self._reserved = reserved
        self._own_files = own_files
        self._block_bytes = 0  # bytes of one block's files, once known
        self._lock = threading.Lock()
        self.policy = make_policy(
            policy, 1, doorkeeper_factor=doorkeeper_factor, sample_rate=sample_rate
        )

    def admit(self, request: BlockRequest) -> int:
        """Leading blocks of ``request`` to write (the ``kvcore_admit`` answer)."""
        names = request.object_names
        if not names:
            return 0
        self._size_from(request)
        known = self._index.by_name.__contains__
        stored = [all(map(known, block)) for block in names]  # as the index knows them
        policy = self.policy
        if policy.uses_ids:
            ids = self.block_ids(request, range(request.num_blocks))
        else:  # the policy decides by count alone: no key is hashed
            ids = [0] * request.num_blocks
        offered = [b for b, present in zip(ids, stored, strict=True) if not present]
        if policy.uses_reads and len(offered) < len(ids):
            policy.read([b for b, present in zip(ids, stored, strict=True) if present])
        if not offered:
            return len(ids)
        taken = policy.offer(offered, self._room())
        if taken == len(offered):
            return len(ids)
        new = 0
        for i, present in enumerate(stored):  # the (taken + 1)-th new block ends the run
            if not present:
                if new == taken:
                    return i
                new += 1
        return len(ids)

    def read(self, request: BlockRequest, blocks: list[int]) -> None:
        """Blocks ``blocks`` (indexes into ``request``) were read: references that hit."""
        if blocks and self.policy.uses_reads:  # no key is hashed for a policy ignoring hits
            self.policy.read(self.block_ids(request, blocks))

    @staticmethod
    def block_ids(request: BlockRequest, blocks: Iterable[int]) -> list[int]:
        """The policy's ids of blocks of ``request`` (by key; by first name for a request
        without keys)."""
        keys = request.block_keys or [names[0] for names in request.object_names]
        return [block_id(keys[i]) for i in blocks]

    def stats(self) -> dict[str, float]:
        out = self.policy.stats()
        out[f"admission_policy_{self.policy.name.replace('-', '_')}"] = 1.0
        return out

    def _room(self) -> int:
        """Blocks that fit before the high watermark makes a write evict."""
        if not self._block_bytes:
            return 0
        index = self._index
        free = index.high_bytes - index.files_bytes - self._reserved() - self._own_files()
        return max(0, free // self._block_bytes)

    def _size_from(self, request: BlockRequest) -> None:
        """Learn a block's size in files (from the layout, from the sizes a request names for
        its own parts, or from the objects indexed) and size the policy for the capacity
        between the watermarks (where a full store sits). A layout-less store that waited for
        indexed objects would size a second-hit doorkeeper for one block until something is
        stored, and refuse every offer of more than two blocks: nothing would ever be."""
        payload: Sequence[int] | None = None
        if self._payload is not None:
            payload = [self._payload.get(p, 0) for p in request.parts]
        elif request.part_nbytes is not None:
            payload = request.part_nbytes
        if payload is not None:
            size = sum(
                header_size(len(encode_name(n))) + nbytes
                for n, nbytes in zip(request.object_names[0], payload, strict=True)
            )
        else:
            index = self._index
            objects = len(index)
            if not objects:
                return
            size = index.files_bytes // objects * len(request.parts)
        if size <= 0 or abs(size - self._block_bytes) * 100 <= self._block_bytes:
            return
        with self._lock:
            self._block_bytes = size
            index = self._index
            between = (index.high_bytes + index.low_bytes) // 2 - self._own_files()
            self.policy.resize(max(0, between // size))
