"""Evictions as a Mooncake client can see them: an object it stored, found gone.

Mooncake's master evicts objects (and other clients remove them) without telling anyone: the
client API has no notification of either. So while someone follows the backend's events
(``kvcore_watch``), the backend remembers the names it stored (at most ``limit``, the oldest
forgotten first) and reports one as evicted when a lookup this client makes (a query, or the
existence check before a write) finds it gone. Objects this client never stored, and objects
it stored but does not look up again, leave the cluster unreported by this client.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvcore import events as ev

__all__ = ["ObservedDrops"]

#: names remembered per client while watched
DEFAULT_LIMIT = 500_000


class ObservedDrops:
    def __init__(self, absent: frozenset[int], limit: int = DEFAULT_LIMIT) -> None:
        self._absent = absent  # the codes a lookup answers for an object that is not there
        self._limit = limit
        self._names: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self.report: Callable[..., None] | None = None

    def watch(self, report: Callable[..., None] | None) -> None:
        with self._lock:
            self.report = report
            self._names.clear()

    def stored(self, names: Sequence[str]) -> None:
        if self.report is None:
            return
        with self._lock:
            for name in names:
                self._names[name] = None
                self._names.move_to_end(name)
            while len(self._names) > self._limit:
                self._names.popitem(last=False)

    def forgotten(self, names: Sequence[str] | None = None) -> None:
        """Removed by this client (kvcore publishes those): ``None``, all of them."""
        if self.report is None:
            return
        with self._lock:
            if names is None:
                self._names.clear()
            else:
                for name in names:
                    self._names.pop(name, None)

    def looked(self, names: Sequence[str], codes: Sequence[int]) -> None:
        """A lookup's per-object answers: a stored name now not found was dropped."""
        report = self.report
        if report is None:
            return
        with self._lock:
            gone = [
                n for n, c in zip(names, codes, strict=True)
                if c in self._absent and n in self._names
            ]  # fmt: skip
            for name in gone:
                del self._names[name]
        if gone:
            report(ev.EVICTED, gone, None, ev.PEER)
