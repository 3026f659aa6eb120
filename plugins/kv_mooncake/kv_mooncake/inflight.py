"""What one client has in flight: buffer pieces, and the names it is writing.

Pieces. Mooncake's TCP transport queues at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` transfers (2048
by default) per peer, across all concurrent calls of a client. Calls that together pass it fail
with -800 or -704 after a one-second stall, and leave the client failing later calls too
(measured with Mooncake 0.3.13 on loopback: two concurrent gets of 1024 pieces each were fine,
three of 1008 failed every key, run after run). kvcore runs reads and writes concurrently, so
the backend admits a call only when its pieces fit in what is left.

Names. Two puts of one name by the same client must never overlap. An upsert takes a name
over at once: the master moves the unfinished put's buffers aside and hands the new writer
fresh ones. The first writer's end call then marks the name's replicas complete, the master
checking only that the same client ends what it started, and so publishes the second
writer's buffers before their bytes have landed: a reader gets whatever those buffers held
before (measured with Mooncake 0.3.13: 2 of 200 reads by four threads writing and reading one
new 4-block sequence returned other bytes, with every object answered whole). Another
client's end call is refused instead (a counted failure), so the guard is per client.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "DEFAULT_QUEUED_TRANSFERS",
    "QUEUE_ENV",
    "NamesBeingWritten",
    "PieceBudget",
    "queued_transfers_limit",
]

QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
DEFAULT_QUEUED_TRANSFERS = 2048


def queued_transfers_limit() -> int:
    """Mooncake's per-peer transfer queue (its variable, or its default)."""
    try:
        return max(1, int(os.environ.get(QUEUE_ENV, DEFAULT_QUEUED_TRANSFERS)))
    except ValueError:
        return DEFAULT_QUEUED_TRANSFERS


class PieceBudget:
    """A counting budget of in-flight pieces; ``acquire`` waits for room up to a timeout."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._cv = threading.Condition()

    def acquire(self, pieces: int, timeout_s: float) -> bool:
        """Take ``pieces`` (at most the limit) once they fit; False when ``timeout_s`` passed."""
        pieces = min(pieces, self.limit)
        deadline = time.monotonic() + max(timeout_s, 0.0)
        with self._cv:
            while self._used + pieces > self.limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            self._used += pieces
            return True

    def release(self, pieces: int) -> None:
        with self._cv:
            self._used -= min(pieces, self.limit)
            self._cv.notify_all()

    @property
    def in_flight(self) -> int:
        with self._cv:
            return self._used


class NamesBeingWritten:
    """The store keys this client's threads are putting right now.

    ``claim`` never waits: a name another thread is putting is left to that thread, and the
    caller treats it as any other writer's unfinished put (it waits for it to land)."""

    def __init__(self) -> None:
        self._names: set[str] = set()
        self._lock = threading.Lock()

    def claim(self, keys: list[str]) -> list[int]:
        """Take the names no other thread is putting; return their indices in ``keys``
        (a name repeated within ``keys`` is taken once)."""
        mine = []
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._names:
                    self._names.add(key)
                    mine.append(i)
        return mine

    @contextmanager
    def held(self, keys: list[str]) -> Iterator[list[int]]:
        """:meth:`claim` for the block's duration: the indices of ``keys`` this thread holds,
        released when it ends."""
        mine = self.claim(keys)
        try:
            yield mine
        finally:
            self.release([keys[i] for i in mine])

    def release(self, keys: list[str]) -> None:
        with self._lock:
            self._names.difference_update(keys)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._names)
