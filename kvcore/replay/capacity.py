"""The capacity that leaves a given number of bytes to a store's objects (a replay at a
capacity in blocks, a benchmark or a test that means a capacity for its objects)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcore.backend import Backend

__all__ = ["capacity_holding"]


def capacity_holding(
    open_at: Callable[[int], Backend],
    objects_bytes: int,
    *,
    objects: int = 0,
    own_bytes_per_object: float = 0.0,
) -> int:
    """The ``capacity_bytes`` that leaves ``objects_bytes`` to a store's objects.

    A store that counts its own files against its capacity (kv_file: its journal and ledger)
    reports them as the stat ``own_files_bytes``, whose size may depend on the capacity and
    the file system: measured on stores ``open_at(capacity)`` opens (and this closes) until
    the two agree. A store without that stat: ``objects_bytes``.

    Own files may also grow with the objects (kv_file's journal holds a record of each): a
    store says by how much in the stat ``own_files_bytes_per_object``, which it knows once it
    has stored one (an empty store just opened may not), and what its own files take however
    few objects there are in ``own_files_bytes_base`` (absent: their size at open). A caller
    that knows the first, and how many ``objects`` the store will hold when full, passes both:
    the own files then count at the larger of their size at open and the base plus
    ``objects`` times ``own_bytes_per_object``.

    .. versionadded:: 0.3
    .. versionchanged:: 0.3 ``objects`` and ``own_bytes_per_object``.
    """
    if objects < 0 or own_bytes_per_object < 0:
        raise ValueError(
            f"objects ({objects}) and own_bytes_per_object ({own_bytes_per_object}) must be >= 0"
        )
    growing = math.ceil(objects * own_bytes_per_object)
    capacity = objects_bytes
    for _ in range(4):  # settles at once unless the own files' size steps with the capacity
        backend = open_at(capacity)
        try:
            stats = backend.stats()
        finally:
            backend.close()
        own = int(stats.get("backend_own_files_bytes", 0))
        if growing:
            own = max(own, int(stats.get("backend_own_files_bytes_base", own)) + growing)
        if objects_bytes + own == capacity:
            break
        capacity = objects_bytes + own
    return capacity
