"""Evicted blocks handed to the tier below, before they leave the tier above.

A tier that can (``kvcore_evict_to``: kv_file) offers the objects a write is about to evict,
a block's parts together, still in place. The stack writes them to the tier below, by the
evicting write's deadline (:mod:`kv_tiered.bounded`), and answers with the names the tier
below stored: only those leave the tier above. So a block is never in neither tier: not
while it moves, not after a crash at any point (until the tier below took it, the tier above
still has it), not when the tier below is down or slow (the block stays, and the tier above
takes only writes that fit without evicting it).

``write-back-on-evict`` needs this of the first tier (nothing else ever reaches the others).
``write-through`` uses it where a tier offers it: a block evicted before its background copy
ran is written down by the eviction instead of being lost.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Sequence

import kvcore
from kv_tiered.bounded import BoundedCalls, Missed
from kv_tiered.names import is_kvcore_name, rows_of_blocks
from kv_tiered.tiers import Tiers
from kvcore import BlockRequest, HostBuffers
from kvcore.evictions import Objects
from kvcore.keys import BlockId, ObjectName
from kvcore.tenants import DEFAULT_TENANT

__all__ = ["EvictionHandDown"]

log = logging.getLogger("kvcore.tiered")

#: one block's objects handed over: its BlockId (or ``("", name)`` for an object under a name
#: kvcore did not build), and each part's name and bytes
_Block = tuple[BlockId | tuple[str, str], dict[str, tuple[str, memoryview]]]


class EvictionHandDown:
    """Evictions of every tier but the last, written to the tier below (see the module
    docstring).

    :param required: the first tier must offer its evictions (``write-back-on-evict``).
    :raises kvcore.ConfigError: ``required`` with fewer than two tiers, or with a first tier
        that cannot offer its evictions.
    """

    def __init__(
        self,
        tiers: Tiers,
        calls: Sequence[BoundedCalls],
        counters: kvcore.Counters,
        *,
        timeout_s: float,
        required: bool,
    ) -> None:
        self._tiers = tiers
        self._calls = calls
        self._counters = counters
        self._timeout_s = timeout_s
        layout = tiers.context.layout
        self._layout_parts = layout.parts if layout is not None else ()
        if required and len(tiers) < 2:
            raise kvcore.ConfigError(
                "invalid config for backend 'tiered': write_policy 'write-back-on-evict' needs "
                "at least two tiers"
            )
        for i, tier in enumerate(tiers[:-1]):
            if not tier.evict_to(functools.partial(self._evicted, i)) and i == 0 and required:
                raise kvcore.ConfigError(
                    f"invalid config for backend 'tiered': tiers[0] ({tier.name}) cannot hand "
                    "over what it evicts (kvcore_evict_to), which write_policy "
                    "'write-back-on-evict' needs (kv_file can)"
                )

    def detach(self) -> None:
        """Stop taking evictions (before the tiers close): they are then plain evictions."""
        for tier in self._tiers[:-1]:
            tier.evict_to(None)

    def _evicted(
        self, tier: int, objects: Objects, deadline: float | None, tenant: str = DEFAULT_TENANT
    ) -> list[str]:
        """The sink of tier ``tier``: write ``objects`` to the tier below by ``deadline``, as
        ``tenant``'s (whose writes stored them above); returns the names stored there."""
        below = tier + 1
        named = None if tenant == DEFAULT_TENANT else tenant
        end = time.monotonic() + self._timeout_s
        if deadline is not None:
            end = min(end, deadline)
        stored: list[str] = []
        for request, buffers in self._requests(objects, end, named):
            # names kvcore did not build in this namespace (an engine's own) get a digest of
            # their own below, like any object (kvcore.integrity): verified, never guessed
            write = functools.partial(_write, self._tiers[below], request)
            try:  # the buffers live while the write may run, abandoned or not
                done = self._calls[below].call(write, end, keep=buffers)
            except Missed:
                self._counters.add(f"tier{below}_failures")
                self._counters.add(f"tier{below}_failures_evicted_write")
                done = 0
            except Exception as exc:  # the tier's own failure (it logged it): nothing stored
                log.debug("kv_tiered: writing evicted blocks to tiers[%d] failed: %s", below, exc)
                done = 0
            for names in request.object_names[:done]:
                stored += names
            self._counters.add("evicted_written_objects", done * len(request.parts))
            kept = request.num_blocks - done
            if kept:
                self._counters.add("evicted_kept_objects", kept * len(request.parts))
            if done < request.num_blocks and time.monotonic() >= end:
                break
        return stored

    def _requests(
        self, objects: Objects, deadline: float, tenant: str | None = None
    ) -> list[tuple[BlockRequest, list[list[bytearray]]]]:
        """One write request per set of parts: each block's objects as one row, in the
        layout's part order, in buffers of their own (an abandoned write may still read
        them after the eviction returned)."""
        layout_parts = self._layout_parts
        # a block of kvcore's names (its BlockId), or an object under any other name alone
        blocks: dict[BlockId | tuple[str, str], dict[str, tuple[str, memoryview]]] = {}
        namespace = self._tiers.context.namespace
        for name, payload in objects:
            fields = ObjectName.parse(name)  # the hand-over names objects as text
            if fields is None or not is_kvcore_name(name, fields, namespace):
                blocks[("", name)] = {"": (name, payload)}  # not kvcore's name here
                continue
            blocks.setdefault(fields.block, {})[fields.part] = (name, payload)
        # one request per set of parts and scope (rank, world size, weight version): its rows
        # are then typed names, the ones kvcore builds, and the tier below finds the digests
        # beside them by their identity, as it does for the stack's own requests
        by_parts: dict[tuple[tuple[str, ...], tuple[object, ...]], list[_Block]] = {}
        for block, block_parts in blocks.items():
            order = [p for p in layout_parts if p in block_parts]
            if len(order) != len(block_parts):
                order = sorted(block_parts)  # parts outside the layout: in a stable order
            scope = block[2:]  # () for an object under another name
            by_parts.setdefault((tuple(order), scope), []).append((block, block_parts))
        requests: list[tuple[BlockRequest, list[list[bytearray]]]] = []
        for (parts, _), rows in by_parts.items():
            payloads = [[rows_parts[p][1] for p in parts] for _, rows_parts in rows]
            sizes = tuple(len(v) for v in payloads[0])
            if any(tuple(len(v) for v in row) != sizes for row in payloads):
                for one in rows:  # blocks of other sizes: a request each
                    requests += self._requests([one[1][p] for p in parts], deadline, tenant)
                continue
            keyed = [b for b, _ in rows if isinstance(b, BlockId)]
            if len(keyed) == len(rows):  # kvcore's names, text for text the ones handed over
                names: Sequence[tuple[str, ...]] = rows_of_blocks(keyed, parts)
                keys = tuple(b.block_key for b in keyed)
            else:  # other names: no identity to give them (their digests are their own)
                names = tuple(tuple(r[p][0] for p in parts) for _, r in rows)
                keys = ()
            buffers = [[bytearray(v) for v in row] for row in payloads]
            requests.append((
                BlockRequest(
                    task_id="tiered-evicted",
                    block_keys=keys,
                    object_names=names,
                    parts=parts,
                    deadline=deadline,
                    host=HostBuffers(
                        tuple(tuple(_address(b) for b in row) for row in buffers), sizes
                    ),
                    num_blocks=len(rows),
                    part_nbytes=sizes,
                    tenant=tenant,
                ),
                buffers,
            ))  # fmt: skip
        return requests


def _write(store: kvcore.Backend, request: BlockRequest) -> int:
    """Write ``request``, then count only the leading blocks the tier then finds: the tier
    above deletes what this answers, so a write that answered success yet stored nothing
    must not count (Mooncake, after a writer was killed in the middle of a put of the same
    key, answers 0 to later puts and stores nothing until its master discards that put)."""
    done = int(store.write(request))
    if not done:
        return 0
    return min(done, int(store.query(request.slice(0, done))))


def _address(buffer: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
