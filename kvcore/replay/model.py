"""Replays on metadata only: the store as kv_file keeps it, the offline optimum, the maximum.

:class:`StoreModel` is kv_file's capacity accounting without the bytes: LRU eviction between
the high and low watermarks, objects pinned by the write that stores them, the admission
policy of :mod:`kvcore.admission` fed the same ids in the same order as the backend feeds it.
A trace replayed on it (``kvcore replay --simulate``) gives the hit rate an I/O replay gives,
in a second instead of minutes, which is what a capacity sweep needs.

Each request is served as the transfer manager serves it: its leading run of stored blocks is
read (a hit per block and its tokens), the rest is computed and offered for writing, the
backend admits a leading run of the offer, and the write stores it.

:func:`unlimited_hits` is the trace's maximum (every block ever written kept), and
:func:`optimal_hits` the offline optimum at a capacity: Belady's MIN with bypass (on a miss,
keep the blocks whose next use is soonest, the new block included, so it may not be stored
at all), ties broken towards keeping a block's prefix (a deeper block goes first). It
maximises the blocks present when referenced, which bounds the prefix hits of any policy.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcore.admission import AdmissionPolicy, PolicyName, block_id, make_policy
from kvcore.replay.trace import Trace, TraceRequest

__all__ = [
    "StoreModel",
    "Tally",
    "block_key",
    "optimal_hits",
    "simulate",
    "unlimited_hits",
]


def block_key(hash_id: int) -> str:
    """The kvcore key a replay stores trace block ``hash_id`` under."""
    return f"trace-{hash_id:x}"


@dataclass
class Tally:
    """What a replay counted, mode aside."""

    requests: int = 0
    block_refs: int = 0
    block_hits: int = 0
    token_refs: int = 0
    token_hits: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_refused: int = 0
    evictions: int = 0
    mismatches: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    read_latency_s: list[float] = field(default_factory=list)

    def served(self, request: TraceRequest, hits: int, tokens_per_block: int) -> None:
        """One request: ``hits`` leading blocks restored."""
        self.requests += 1
        n = len(request.hash_ids)
        self.block_refs += n
        self.block_hits += hits
        tokens = [request.block_tokens(i, tokens_per_block) for i in range(n)]
        self.token_refs += sum(tokens)
        self.token_hits += sum(tokens[:hits])

    def error(self, message: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(message)

    @property
    def hit_rate_blocks(self) -> float:
        return self.block_hits / self.block_refs if self.block_refs else 0.0

    @property
    def hit_rate_tokens(self) -> float:
        return self.token_hits / self.token_refs if self.token_refs else 0.0


class StoreModel:
    """kv_file's store in metadata (see the module docstring).

    :param capacity_blocks: the store's capacity, in blocks.
    :param block_bytes: bytes one block takes in the store (only rounding depends on it).
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

    @property
    def files_bytes(self) -> int:
        return len(self.lru) * self.block_bytes

    def serve(self, ids: Sequence[int]) -> tuple[int, int, int]:
        """One request of blocks ``ids`` (policy ids): ``(hits, written, refused)``."""
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

    def _admit(self, offer: Sequence[int]) -> int:
        """kv_file's ``kvcore_admit``: stored blocks admitted (and seen), the rest offered."""
        present = [b in self.lru for b in offer]
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


def simulate(
    trace: Trace,
    capacity_blocks: int,
    policy: PolicyName,
    *,
    block_bytes: int = 1 << 14,
    high_watermark: float = 1.0,
    low_watermark: float = 1.0,
    doorkeeper_factor: float = 2.0,
    sample_rate: float = 1 / 16,
    progress: Callable[[int], None] | None = None,
) -> tuple[Tally, StoreModel]:
    """Replay ``trace`` on a :class:`StoreModel` (no I/O)."""
    model = StoreModel(
        capacity_blocks,
        policy,
        high_watermark=high_watermark,
        low_watermark=low_watermark,
        block_bytes=block_bytes,
        doorkeeper_factor=doorkeeper_factor,
        sample_rate=sample_rate,
    )
    tally = Tally()
    ids_of: dict[int, int] = {}
    tpb = trace.tokens_per_block
    for n, request in enumerate(trace.requests):
        ids = [
            ids_of.get(b) or ids_of.setdefault(b, block_id(block_key(b))) for b in request.hash_ids
        ]
        hits, written, refused = model.serve(ids)
        tally.served(request, hits, tpb)
        tally.blocks_written += written
        tally.bytes_written += written * block_bytes
        tally.blocks_refused += refused
        if progress is not None and n % 256 == 255:
            progress(256)
    tally.evictions = model.evictions
    if progress is not None:
        progress(len(trace) % 256)
    return tally, model


def _prefix_hits(
    tally: Tally, request: TraceRequest, present: Callable[[int], bool], tpb: int
) -> None:
    hits = 0
    for b in request.hash_ids:
        if not present(b):
            break
        hits += 1
    tally.served(request, hits, tpb)


def unlimited_hits(trace: Trace) -> Tally:
    """The trace's maximum: every block is stored once written, and never evicted."""
    seen: set[int] = set()
    tally = Tally()
    for request in trace.requests:
        _prefix_hits(tally, request, seen.__contains__, trace.tokens_per_block)
        seen.update(request.hash_ids)
    tally.blocks_written = len(seen)
    return tally


def optimal_hits(trace: Trace, capacity_blocks: int) -> Tally:
    """Belady's MIN with bypass at ``capacity_blocks`` (see the module docstring)."""
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    never = float("inf")
    # the next reference of each block after each reference, by one backward pass
    flat = [b for r in trace.requests for b in r.hash_ids]
    next_use: list[float] = [never] * len(flat)
    last: dict[int, int] = {}
    for t in range(len(flat) - 1, -1, -1):
        b = flat[t]
        next_use[t] = last.get(b, never)
        last[b] = t
    cached: dict[int, tuple[float, int]] = {}  # block -> (its next use, its depth)
    heap: list[tuple[float, int, int]] = []  # (-next use, -depth, block): furthest first
    tally = Tally()
    tpb = trace.tokens_per_block
    t = 0
    for request in trace.requests:
        _prefix_hits(tally, request, cached.__contains__, tpb)
        for depth, b in enumerate(request.hash_ids):
            nxt = next_use[t]
            t += 1
            key = (nxt, depth)
            if b in cached:
                cached[b] = key
                heapq.heappush(heap, (-nxt, -depth, b))
                continue
            if nxt == never:
                continue  # never used again: not worth a write
            if len(cached) >= capacity_blocks:
                while True:  # the furthest-used cached block (stale heap entries skipped)
                    neg_next, neg_depth, victim = heap[0]
                    if cached.get(victim) == (-neg_next, -neg_depth):
                        break
                    heapq.heappop(heap)
                if (-neg_next, -neg_depth) <= key:
                    continue  # the new block is used last: bypass it
                heapq.heappop(heap)
                del cached[victim]
                tally.evictions += 1
            cached[b] = key
            heapq.heappush(heap, (-nxt, -depth, b))
            tally.blocks_written += 1
    return tally
