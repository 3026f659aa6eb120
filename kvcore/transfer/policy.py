"""Which blocks a write-back stores: all of them, or only those used often enough."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

__all__ = ["WritePolicy"]


class WritePolicy:
    """``write_through`` stores every block; ``selective`` stores a block once it has been
    used (read or written back) ``min_hits`` times, so one-off prompts don't churn the store.

    Use counts live in an LRU table of ``table_size`` keys: a key pushed out starts again.
    """

    def __init__(
        self, kind: Literal["write_through", "selective"], min_hits: int, table_size: int
    ) -> None:
        self.kind = kind
        self.min_hits = min_hits
        self.table_size = table_size
        self._hits: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def used(self, keys: Sequence[str]) -> None:
        """Count one use of each key."""
        if self.kind != "selective":
            return
        with self._lock:
            for k in keys:
                self._hits[k] = self._hits.get(k, 0) + 1
                self._hits.move_to_end(k)
            while len(self._hits) > self.table_size:
                self._hits.popitem(last=False)

    def eligible_end(self, keys: Sequence[str], stored: int) -> int:
        """End of the leading run, from ``stored``, of blocks this policy lets us store."""
        if self.kind == "write_through":
            return len(keys)
        with self._lock:
            end = stored
            while end < len(keys) and self._hits.get(keys[end], 0) >= self.min_hits:
                end += 1
        return end
