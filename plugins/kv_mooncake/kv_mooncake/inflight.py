"""How many buffer pieces one client may have in flight at once.

Mooncake's TCP transport queues at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` transfers (2048
by default) per peer, across all concurrent calls of a client. Calls that together pass it fail
with -800 or -704 after a one-second stall, and leave the client failing later calls too
(measured with Mooncake 0.3.13 on loopback: two concurrent gets of 1024 pieces each were fine,
three of 1008 failed every key, run after run). kvcore runs reads and writes concurrently, so
the backend admits a call only when its pieces fit in what is left.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["DEFAULT_QUEUED_TRANSFERS", "QUEUE_ENV", "PieceBudget", "queued_transfers_limit"]

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
