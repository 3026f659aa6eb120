"""Replays on metadata only: a backend's own store model, the offline optimum, the maximum.

A backend may offer its capacity accounting without the bytes as ``store_model`` on its class
(:class:`StoreModelFactory`; kv_file's is ``kv_file.model.StoreModel``: LRU eviction between
the watermarks, pinned objects, its admission policy). A trace replayed on it (``kvcore replay
--simulate``) gives the hit rate an I/O replay gives, in a second instead of minutes, which is
what a capacity sweep needs; the model lives with the backend it models, so it changes with it.

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
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvcore.admission import PolicyName, block_id
from kvcore.registry import load_backend_class
from kvcore.replay.trace import Trace, TraceRequest
from kvcore.tenants import TenantSettings

__all__ = [
    "SimulatedStore",
    "StoreModelFactory",
    "Tally",
    "block_key",
    "optimal_hits",
    "simulate",
    "store_model_of",
    "unlimited_hits",
]


def block_key(hash_id: int, tenant: str | None = None) -> str:
    """The kvcore key a replay stores trace block ``hash_id`` (of ``tenant``'s trace, in a
    merged trace) under.

    .. versionchanged:: 0.3 ``tenant``: the same id in two tenants' traces is two blocks
    """
    return f"trace-{hash_id:x}" if tenant is None else f"trace-{tenant}-{hash_id:x}"


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
    #: the same counts per tenant, for a trace with tenants (:func:`kvcore.replay.trace.merge_traces`)
    tenants: dict[str, Tally] = field(default_factory=dict)

    def of(self, tenant: str) -> Tally:
        """``tenant``'s own tally (created on first use)."""
        found = self.tenants.get(tenant)
        if found is None:
            found = self.tenants[tenant] = Tally()
        return found

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


class SimulatedStore(Protocol):
    """A backend's store in metadata (what a simulated replay serves requests from).

    .. versionadded:: 0.3
    """

    evictions: int

    def serve(self, ids: Sequence[int]) -> tuple[int, int, int]:
        """One request of blocks ``ids`` (admission-policy ids): ``(hits, written, refused)``.
        A model made with ``tenants`` also takes ``tenant=`` (the request's tenant)."""
        ...


class StoreModelFactory(Protocol):
    """What a backend class offers as ``store_model`` for ``kvcore replay --simulate``: its own
    capacity accounting, so the simulation changes with the backend (kv_file's:
    ``kv_file.model.StoreModel``).

    .. versionadded:: 0.3
    .. versionchanged:: 0.3 a model of tenants' shares also takes ``tenants=``
       (:class:`kvcore.tenants.TenantSettings`): a replay with tenants passes it, and only it
    """

    def __call__(
        self,
        capacity_blocks: int,
        policy: PolicyName,
        *,
        high_watermark: float,
        low_watermark: float,
        block_bytes: int,
        doorkeeper_factor: float,
        sample_rate: float,
    ) -> SimulatedStore: ...


def store_model_of(backend: str | type) -> StoreModelFactory:
    """The store model the backend ``backend`` (a name or a class) offers for simulated
    replays.

    :raises ValueError: the backend offers none (a simulation of it would be kv_file's, not
        its own).
    """
    cls = load_backend_class(backend) if isinstance(backend, str) else backend
    factory = getattr(cls, "store_model", None)
    if factory is None:
        name = backend if isinstance(backend, str) else cls.__name__
        raise ValueError(
            f"backend {name!r} offers no store model (`store_model`) to simulate a replay on; "
            "replay it with I/O instead (without --simulate)"
        )
    found: StoreModelFactory = factory
    return found


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
    backend: str | type = "file",
    tenants: TenantSettings | None = None,
) -> tuple[Tally, SimulatedStore]:
    """Replay ``trace`` on the store model ``backend`` offers (:func:`store_model_of`; no I/O).

    A trace with tenants (:func:`kvcore.replay.trace.merge_traces`) is also counted per tenant
    (:attr:`Tally.tenants`); ``tenants`` gives their shares of the store (None: one LRU for
    every tenant's blocks).

    .. versionchanged:: 0.3 ``backend``: the model is the backend's own (it was a copy of
       kv_file's accounting kept in the core)
    .. versionchanged:: 0.3 ``tenants``, and counts per tenant
    """
    shares = {} if tenants is None else {"tenants": tenants}
    model = store_model_of(backend)(
        capacity_blocks,
        policy,
        high_watermark=high_watermark,
        low_watermark=low_watermark,
        block_bytes=block_bytes,
        doorkeeper_factor=doorkeeper_factor,
        sample_rate=sample_rate,
        **shares,
    )
    tally = Tally()
    ids_of: dict[tuple[str | None, int], int] = {}
    tpb = trace.tokens_per_block
    for n, request in enumerate(trace.requests):
        tenant = request.tenant
        ids = [
            ids_of.get((tenant, b))
            or ids_of.setdefault((tenant, b), block_id(block_key(b, tenant)))
            for b in request.hash_ids
        ]
        if tenants is not None:
            # a trace's tenant is its own (one the settings do not name has no share)
            owner = tenant if tenant is not None else tenants.default_tenant
            hits, written, refused = model.serve(ids, tenant=owner)  # type: ignore[call-arg]
        else:
            hits, written, refused = model.serve(ids)
        tally.served(request, hits, tpb)
        tally.blocks_written += written
        tally.bytes_written += written * block_bytes
        tally.blocks_refused += refused
        if tenant is not None:
            own = tally.of(tenant)
            own.served(request, hits, tpb)
            own.blocks_written += written
            own.bytes_written += written * block_bytes
            own.blocks_refused += refused
        if progress is not None and n % 256 == 255:
            progress(256)
    tally.evictions = model.evictions
    for name, count in getattr(model, "evicted_by", {}).items():
        tally.of(name).evictions = count
    if progress is not None:
        progress(len(trace) % 256)
    return tally, model


def _prefix_hits(
    tally: Tally, request: TraceRequest, present: Callable[[Hashable], bool], tpb: int
) -> None:
    hits = 0
    for b in _blocks_of(request):
        if not present(b):
            break
        hits += 1
    tally.served(request, hits, tpb)


def _blocks_of(request: TraceRequest) -> Sequence[Hashable]:
    """A request's blocks as a replay tells them apart: by id, and by tenant where the trace
    has tenants (two tenants' equal ids are two blocks, :func:`block_key`)."""
    if request.tenant is None:
        return request.hash_ids
    return [(request.tenant, b) for b in request.hash_ids]


def unlimited_hits(trace: Trace) -> Tally:
    """The trace's maximum: every block is stored once written, and never evicted."""
    seen: set[Hashable] = set()
    tally = Tally()
    for request in trace.requests:
        _prefix_hits(tally, request, seen.__contains__, trace.tokens_per_block)
        seen.update(_blocks_of(request))
    tally.blocks_written = len(seen)
    return tally


def optimal_hits(trace: Trace, capacity_blocks: int) -> Tally:
    """Belady's MIN with bypass at ``capacity_blocks`` (see the module docstring)."""
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    never = float("inf")
    # the next reference of each block after each reference, by one backward pass
    flat = [b for r in trace.requests for b in _blocks_of(r)]
    next_use: list[float] = [never] * len(flat)
    last: dict[Hashable, int] = {}
    for t in range(len(flat) - 1, -1, -1):
        b = flat[t]
        next_use[t] = last.get(b, never)
        last[b] = t
    cached: dict[Hashable, tuple[float, int]] = {}  # block -> (its next use, its depth)
    # (-next use, -depth, block): furthest first; a trace's blocks are all ids, or all
    # (tenant, id) pairs, so ties compare like with like
    heap: list[tuple[float, int, Any]] = []
    tally = Tally()
    tpb = trace.tokens_per_block
    t = 0
    for request in trace.requests:
        _prefix_hits(tally, request, cached.__contains__, tpb)
        for depth, b in enumerate(_blocks_of(request)):
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
