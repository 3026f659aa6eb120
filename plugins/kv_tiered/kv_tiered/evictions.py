"""``write-back-on-evict``: each tier hands what it evicts to the tier below it.

A tier that can (``kvcore_evict_to``: kv_file) calls back with each evicted object's verified
bytes before it deletes them; the stack writes them to the tier below before that call
returns, so a block is never in neither tier. Objects are written a block at a time (the tier
below may keep a digest per block): a block whose parts are evicted in different calls waits,
copied, for its last part (at most ``backlog_blocks`` such blocks; past that the oldest is
dropped and counted).
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections import OrderedDict

import kvcore
from kv_tiered.tiers import Tiers
from kvcore import BlockRequest, HostBuffers
from kvcore.keys import parse_object_name

__all__ = ["EvictionHandDown"]


class EvictionHandDown:
    """Evictions of every tier but the last, written to the tier below (see the module
    docstring).

    :raises kvcore.ConfigError: fewer than two tiers, or a first tier that cannot hand its
        evictions over (nothing would ever reach the others).
    """

    def __init__(
        self, tiers: Tiers, counters: kvcore.Counters, *, max_pending: int, timeout_s: float
    ) -> None:
        self._tiers = tiers
        self._counters = counters
        self._max_pending = max_pending
        self._timeout_s = timeout_s
        layout = tiers.context.layout
        self._layout_parts = layout.parts if layout is not None else ()
        self._namespace = tiers.context.namespace
        #: blocks some of whose parts were evicted, waiting for the rest
        self._pending: OrderedDict[tuple, dict[str, tuple[str, bytes]]] = OrderedDict()
        if len(tiers) < 2:
            raise kvcore.ConfigError(
                "invalid config for backend 'tiered': write_policy 'write-back-on-evict' needs "
                "at least two tiers"
            )
        for i, tier in enumerate(tiers[:-1]):
            if not tier.evict_to(functools.partial(self._evicted, i)) and i == 0:
                raise kvcore.ConfigError(
                    f"invalid config for backend 'tiered': tiers[0] ({tier.name}) cannot hand "
                    "over what it evicts (kvcore_evict_to), which write_policy "
                    "'write-back-on-evict' needs (kv_file can)"
                )

    def detach(self) -> None:
        """Stop handing evictions down (before the tiers close)."""
        for tier in self._tiers[:-1]:
            tier.evict_to(None)

    def _evicted(self, tier: int, objects: list[tuple[str, memoryview]]) -> None:
        ready: list[dict[str, tuple[str, bytes]]] = []
        pending = self._pending
        layout_parts = self._layout_parts
        for name, payload in objects:
            fields = parse_object_name(name)
            if fields is None or fields.namespace != self._namespace:
                ready.append({"": (name, bytes(payload))})  # not a block kvcore named: alone
                continue
            key = (fields.block_key, fields.rank, fields.world_size, fields.weight_version)
            parts = pending.setdefault(key, {})
            parts[fields.part] = (name, bytes(payload))
            if fields.part not in layout_parts or set(parts) >= set(layout_parts):
                del pending[key]
                ready.append(parts)
        while len(pending) > self._max_pending:
            _, dropped = pending.popitem(last=False)
            self._counters.add("evicted_lost_objects", len(dropped))
        for block in ready:
            self._write(tier + 1, block)

    def _write(self, below: int, block: dict[str, tuple[str, bytes]]) -> None:
        layout_parts = self._layout_parts
        parts = [p for p in layout_parts if p in block] if set(block) <= set(layout_parts) else []
        if len(parts) != len(block):
            parts = list(block)  # parts outside the layout: a block of its own
        names = tuple(block[p][0] for p in parts)
        fields = parse_object_name(names[0])
        buffers = [bytearray(block[p][1]) for p in parts]
        sizes = tuple(len(b) for b in buffers)
        request = BlockRequest(
            task_id="tiered-evicted",
            block_keys=(fields.block_key,) if fields is not None else (),
            object_names=(names,),
            parts=tuple(parts),
            deadline=time.monotonic() + self._timeout_s,
            host=HostBuffers((tuple(_address(b) for b in buffers),), sizes),
            num_blocks=1,
            part_nbytes=sizes,
        )
        done = int(self._tiers.store(below, request).write(request))
        self._counters.add("evicted_written_objects", len(parts) * done)
        if not done:
            self._counters.add("evicted_lost_objects", len(parts))


def _address(buffer: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
