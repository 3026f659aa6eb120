"""The eviction hand-over (``kvcore_evict_to``): victims read back from their files, verified,
and offered to the tier below before they leave.

The catalog calls :class:`HandOver` outside the journal's lock with the victims a write's
admission chose (see :meth:`kv_file.catalog.Catalog._admit_handing_over`); only the digests it
returns are evicted.
"""

from __future__ import annotations

import kvcore
from kv_file.objfile import encode_name, header_size
from kv_file.objio import ReadOutcome, read_name, read_object
from kvcore.evictions import EvictionSink

__all__ = ["HandOver"]


class HandOver:
    """Offers victims to :attr:`sink` (as :func:`kvcore.evictions.sink_caller` calls it; None:
    detached, nothing may leave); counts ``evict_handed_over`` and
    ``evict_handover_unreadable`` in ``counters``."""

    def __init__(self, counters: kvcore.Counters) -> None:
        self.sink: EvictionSink | None = None
        self._counters = counters

    def __call__(
        self, victims: list[tuple[int, str | None, int, str, str]], deadline: float | None
    ) -> set[int]:
        """Read victims (``(digest, name, size, path, tenant)``) from their files, verified,
        and offer them to the sink, one call per tenant (in the order the tenants' first
        victims come); returns the digests that may leave: those it took, and those with
        nothing left to hand over (gone meanwhile, or corrupt)."""
        sink = self.sink
        if sink is None:
            return set()
        by_tenant: dict[str, list[tuple[str, memoryview]]] = {}
        offered: dict[tuple[str, str], int] = {}
        nothing_to_keep: set[int] = set()
        for digest, name, size, path, tenant in victims:
            raw = encode_name(name) if name is not None else read_name(path)
            if raw is None:
                nothing_to_keep.add(digest)
                continue
            payload = size - header_size(len(raw))
            buffer = memoryview(bytearray(max(payload, 0)))
            outcome = read_object(path, raw, [buffer], digest=digest, expected_len=payload)
            if outcome is ReadOutcome.OK:
                text = raw.decode("utf-8", "surrogatepass")
                by_tenant.setdefault(tenant, []).append((text, buffer))
                offered[tenant, text] = digest
            else:  # evicted or removed by another process meanwhile, or corrupt
                if outcome is not ReadOutcome.MISSING:
                    self._counters.add("evict_handover_unreadable")
                nothing_to_keep.add(digest)
        taken: set[int] = set()
        for tenant, objects in by_tenant.items():
            stored = sink(objects, deadline, tenant)
            taken.update(offered[tenant, n] for n in stored if (tenant, n) in offered)
        self._counters.add("evict_handed_over", len(taken))
        return taken | nothing_to_keep
