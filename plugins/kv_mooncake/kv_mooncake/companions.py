"""Reading metadata companions (:mod:`kv_mooncake.block_meta`) many at a time, each in a slot
of its own.

Mooncake's ``get_batch`` copies every object of a call through one shared copy buffer (16 MiB
on a lookup client): an object that is not a companion kvcore wrote (15 MiB under a ``#meta``
key) fills it, and the good companions after it come back empty (measured on Mooncake 0.3.13:
``get_batch`` of 15 MiB, 1 MiB and 100 bytes answered the third with nothing). Here each
companion is read into a fixed slot of one registered buffer (``batch_get_into``): an object
larger than its slot fails alone (-600) and is read by itself only if it could still be a
companion (:data:`COMPANION_MAX`), so nothing one object does reaches its neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kv_mooncake.codes import INVALID_PARAMS
from kv_mooncake.regions import RegionTable
from kvcore import Counters

__all__ = ["COMPANIONS_PER_CALL", "COMPANION_MAX", "COMPANION_SLOT", "CompanionReader"]

#: companions per client call
COMPANIONS_PER_CALL = 512
#: bytes of a companion's slot: its header and digest (18), a name of a few hundred bytes and
#: at most kvcore.MAX_BLOCK_META_BYTES (2048) of metadata fit with room to spare
COMPANION_SLOT = 8 << 10
#: a larger object under a companion's key is read alone up to this size (a very long name);
#: past it, it is no companion kvcore wrote, and is not read at all
COMPANION_MAX = 1 << 20


class CompanionReader:
    """Companions by key, through one Mooncake client (``store``), whose registered regions
    ``regions`` tracks."""

    def __init__(self, store: Any, regions: RegionTable, counters: Counters) -> None:
        self._store = store
        self._regions = regions
        self._counters = counters

    def read(self, keys: Sequence[str]) -> list[bytes]:
        """Each key's object, ``b""`` where it is absent, failed, or too large to be a
        companion (counted: ``block_meta_oversized``)."""
        out = [b""] * len(keys)
        for lo in range(0, len(keys), COMPANIONS_PER_CALL):
            chunk = list(keys[lo : lo + COMPANIONS_PER_CALL])
            for i, blob in enumerate(self._read_slots(chunk)):
                out[lo + i] = blob
        return out

    def _read_slots(self, keys: list[str]) -> list[bytes]:
        slots = np.empty(len(keys) * COMPANION_SLOT, np.uint8)
        base = slots.ctypes.data
        pinned, _ = self._regions.pin([(base, base + slots.nbytes)])
        try:
            codes = self._store.batch_get_into(
                keys,
                [base + i * COMPANION_SLOT for i in range(len(keys))],
                [COMPANION_SLOT] * len(keys),
            )
        finally:
            self._regions.unpin(pinned)
        out: list[bytes] = []
        for i, code in enumerate(codes):
            at = i * COMPANION_SLOT
            if 0 < code <= COMPANION_SLOT:
                out.append(slots[at : at + code].tobytes())
            elif code == INVALID_PARAMS:  # larger than its slot
                out.append(self._read_alone(keys[i]))
            else:  # absent (the block was written without metadata), or the read failed
                out.append(b"")
        return out

    def _read_alone(self, key: str) -> bytes:
        size = self._store.get_size(key)
        if size <= 0:
            return b""
        if size > COMPANION_MAX:
            self._counters.add("block_meta_oversized")
            return b""
        return bytes(self._store.get(key))
