"""The capacity that leaves a given number of bytes to a store's objects (a replay at a
capacity in blocks, a benchmark or a test that means a capacity for its objects)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcore.backend import Backend

__all__ = ["capacity_holding"]


def capacity_holding(open_at: Callable[[int], Backend], objects_bytes: int) -> int:
    """The ``capacity_bytes`` that leaves ``objects_bytes`` to a store's objects.

    A store that counts its own files against its capacity (kv_file: its journal and ledger)
    reports them as the stat ``own_files_bytes``, whose size may depend on the capacity and
    the file system: measured on stores ``open_at(capacity)`` opens (and this closes) until
    the two agree. A store without that stat: ``objects_bytes``.

    .. versionadded:: 0.3
    """
    capacity = objects_bytes
    for _ in range(4):  # settles at once unless the own files' size steps with the capacity
        backend = open_at(capacity)
        try:
            own = int(backend.stats().get("backend_own_files_bytes", 0))
        finally:
            backend.close()
        if objects_bytes + own == capacity:
            break
        capacity = objects_bytes + own
    return capacity
