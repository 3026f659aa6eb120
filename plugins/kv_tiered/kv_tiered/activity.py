"""The stack's callers in flight, so background copies run in their pauses.

A background copy (a promotion, a write-through copy) reads and writes as much as the call
that caused it. Run beside the callers' next calls, it takes their CPU, memory bandwidth and
disk: a 2-core host loses a quarter of its write-back speed to its own write-through. So a copy
waits until no caller's read or write has been in flight for ``settle_s``, but never longer
than ``max_wait_s`` (under constant load it runs anyway, beside them) and never past its
deadline.
"""

from __future__ import annotations

import threading
import time

__all__ = ["Activity"]


class Activity:
    """Counts the callers' calls in flight (``with activity:`` around each)."""

    def __init__(self, settle_s: float = 0.005) -> None:
        self.settle_s = settle_s
        self._active = 0
        self._last_end = -float("inf")
        self._cond = threading.Condition()

    def __enter__(self) -> Activity:
        with self._cond:
            self._active += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._active -= 1
            self._last_end = time.monotonic()
            if not self._active:
                self._cond.notify_all()

    def wait_quiet(self, until: float) -> bool:
        """Wait until no call has been in flight for ``settle_s``, or until the monotonic
        instant ``until``; True if it is quiet."""
        with self._cond:
            while True:
                now = time.monotonic()
                if not self._active and now - self._last_end >= self.settle_s:
                    return True
                if now >= until:
                    return False
                if self._active:
                    self._cond.wait(until - now)
                else:  # a call just ended: wait out the settle time (another may follow)
                    self._cond.wait(min(until, self._last_end + self.settle_s) - now)
