"""kv_file's store in metadata: what ``kvcore replay --simulate`` replays a trace on.

:class:`StoreModel` is this backend's capacity accounting without the bytes: LRU eviction
between the high and low watermarks, objects pinned by the write that stores them, the
admission policy of :mod:`kvcore.admission` fed the same ids in the same order as the backend
feeds it (``FileBackend.kvcore_admit`` and ``Index.plan_admission``). It lives beside them so
that a change to kv_file's eviction changes the simulation with it: the backend class offers
it as ``FileBackend.store_model``, which kvcore's replay driver asks for by the backend's name
(:func:`kvcore.replay.model.simulate`). ``tests/test_replay.py::
test_real_kv_file_io_gives_the_models_exact_counts`` keeps it equal to the real store's
decisions (an I/O replay on kv_file and a simulated one count the same hits, writes,
refusals and evictions).

With tenants (:mod:`kvcore.tenants`), the model keeps one LRU per tenant and picks victims by
the tenants' shares, the rule kv_file's store enforces (:mod:`kv_file.shares`); an I/O replay
with tenants counts what the model counts (``tests/test_tenants.py``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvcore.admission import AdmissionPolicy, PolicyName, make_policy
from kvcore.tenants import DEFAULT_TENANT, TenantLRU, TenantSettings

__all__ = ["StoreModel"]


class StoreModel:
    """kv_file's store in metadata (see the module docstring).

    :param capacity_blocks: the store's capacity, in blocks.
    :param block_bytes: bytes one block takes in the store (only rounding depends on it).
    :param tenants: the tenants' shares (:mod:`kvcore.tenants`): each request's blocks are its
        tenant's, victims are chosen by the shares (None: one LRU for every block).

    .. versionchanged:: 0.3 ``tenants``, and :meth:`serve`'s ``tenant``
    """

    def __init__(
        self,
        capacity_blocks: int,
        policy: PolicyName | AdmissionPolicy,
        *,
        high_watermark: float = 1.0,
        low_watermark: float = 1.0,
        block_bytes: int = 1 << 14,
        doorkeeper_factor: float = 2.0,
        sample_rate: float = 1 / 16,
        tenants: TenantSettings | None = None,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.block_bytes = block_bytes
        capacity = capacity_blocks * block_bytes
        self.capacity_bytes = capacity
        self.high_bytes = int(capacity * high_watermark)
        self.low_bytes = int(capacity * low_watermark)
        if isinstance(policy, AdmissionPolicy):
            self.policy = policy
        else:
            self.policy = make_policy(
                policy, 1, doorkeeper_factor=doorkeeper_factor, sample_rate=sample_rate
            )
        # as kv_file sizes it: the capacity between the watermarks, in blocks
        self.policy.resize((self.high_bytes + self.low_bytes) // 2 // block_bytes)
        self.lru: OrderedDict[int, None] = OrderedDict()  # policy ids, oldest first
        self.evictions = 0
        #: with tenants: every block in one LRU per tenant, victims by the shares
        self.book: TenantLRU[int] | None = None
        if tenants is not None:
            tenants.check_capacity(capacity, "tenants")
            self.book = TenantLRU(tenants)
        #: blocks evicted and refused, per tenant (with tenants)
        self.evicted_by: Counter[str] = Counter()
        self.refused_by: Counter[str] = Counter()

    @property
    def files_bytes(self) -> int:
        held = len(self.lru) if self.book is None else len(self.book)
        return held * self.block_bytes

    def serve(self, ids: Sequence[int], tenant: str = DEFAULT_TENANT) -> tuple[int, int, int]:
        """One request of blocks ``ids`` (policy ids) of ``tenant``: ``(hits, written,
        refused)``."""
        if self.book is not None:
            return self._serve_shared(ids, tenant, self.book)
        lru = self.lru
        hits = 0
        for b in ids:
            if b not in lru:
                break
            hits += 1
        for b in ids[:hits]:  # the read: most recently used, in the request's order
            lru.move_to_end(b)
        self.policy.read(ids[:hits])
        rest = ids[hits:]
        if not rest:
            return hits, 0, 0
        end = self._admit(rest)
        written = self._write(rest[:end])
        return hits, written, len(rest) - end

    def _serve_shared(
        self, ids: Sequence[int], tenant: str, book: TenantLRU[int]
    ) -> tuple[int, int, int]:
        """:meth:`serve` with tenants: the same steps, victims by the shares."""
        hits = 0
        for b in ids:
            if b not in book:
                break
            hits += 1
        book.touch(ids[:hits])
        self.policy.read(ids[:hits])
        rest = ids[hits:]
        if not rest:
            return hits, 0, 0
        end = self._admit(rest)
        written = self._write_shared(rest[:end], tenant, book)
        # per tenant: every block offered and not stored (by admission, its quota or no room)
        self.refused_by[tenant] += len(rest) - written
        return hits, written, len(rest) - end

    def _write_shared(self, blocks: Sequence[int], tenant: str, book: TenantLRU[int]) -> int:
        """:meth:`_write` with tenants: a block past the tenant's quota evicts the tenant's own
        oldest; past the high watermark, victims down to the low one come from the tenants
        over their reserved share (:meth:`TenantLRU.victim`). The request's blocks are kept
        (pinned); a block that finds no room ends the write (the rest lacks its prefix).

        The store evicts nothing for an object it refuses (``Index.plan_admission``); here
        that needs no step: blocks are of one size and no write is in
        flight, so one victim always makes the room, and a block is refused only where there
        is none to take."""
        size = self.block_bytes
        keep = {b for b in blocks if b in book}
        book.touch(b for b in blocks if b in keep)
        admitted = 0
        for b in blocks:
            if b in keep:
                continue
            while book.over_quota(tenant, size):
                own = book.own_victim(tenant, keep)
                if own is None:
                    return admitted
                self._evict(book, own)
            if self.files_bytes + size > self.high_bytes:
                while self.files_bytes + size > self.low_bytes:
                    victim = book.victim(tenant, keep)
                    if victim is None:
                        break
                    self._evict(book, victim)
            if self.files_bytes + size > self.capacity_bytes:
                return admitted
            book.add(b, tenant, size)
            keep.add(b)
            admitted += 1
        return admitted

    def _evict(self, book: TenantLRU[int], victim: int) -> None:
        owner = book.owner(victim)
        book.remove(victim)
        self.evictions += 1
        if owner is not None:
            self.evicted_by[owner] += 1

    def _holds(self, block: int) -> bool:
        return block in (self.lru if self.book is None else self.book)

    def _admit(self, offer: Sequence[int]) -> int:
        """kv_file's ``kvcore_admit``: stored blocks admitted (and seen), the rest offered."""
        present = [self._holds(b) for b in offer]
        if any(present):
            self.policy.read([b for b, p in zip(offer, present, strict=True) if p])
        new = [b for b, p in zip(offer, present, strict=True) if not p]
        if not new:
            return len(offer)
        room = max(0, (self.high_bytes - self.files_bytes) // self.block_bytes)
        taken = self.policy.offer(new, room)
        if taken == len(new):
            return len(offer)
        seen = 0
        for i, p in enumerate(present):
            if not p:
                if seen == taken:
                    return i
                seen += 1
        return len(offer)

    def _write(self, blocks: Sequence[int]) -> int:
        """kv_file's ``kvcore_write``: stored blocks skipped (pinned, touched), the others
        admitted in order after evicting LRU blocks down to the low watermark as needed."""
        lru, size = self.lru, self.block_bytes
        pinned = {b for b in blocks if b in lru}
        new = [b for b in blocks if b not in pinned]
        projected = self.files_bytes
        victims: list[int] = []
        admitted = 0
        if projected + len(new) * size <= self.high_bytes:
            admitted = len(new)
        else:
            candidates = (b for b in lru if b not in pinned)
            for _ in new:
                if projected + size > self.high_bytes:
                    while projected + size > self.low_bytes:
                        victim = next(candidates, None)
                        if victim is None:
                            break
                        victims.append(victim)
                        projected -= size
                if projected + size > self.capacity_bytes:
                    break
                projected += size
                admitted += 1
        for v in victims:
            del lru[v]
        self.evictions += len(victims)
        for b in blocks:
            if b in pinned:
                lru.move_to_end(b)
        for b in new[:admitted]:
            lru[b] = None
        return admitted
