"""Events (``kvcore_watch``): every change of the directory, whoever makes it, reported in the
journal's order (see :mod:`kv_file.catalog`), so a router following any one process sees the
store."""

from __future__ import annotations

import threading
from collections.abc import Callable

import kvcore
from kv_file.catalog import Catalog
from kvcore import events as ev
from kvcore.threads import start_thread

__all__ = ["FOLLOW_INTERVAL_S", "Watch"]

#: While watched, other processes' changes are applied (and reported) this often at least.
FOLLOW_INTERVAL_S = 0.05


class Watch:
    """The catalog's reporting, and while watched a follower thread that applies (and so
    reports) other processes' records promptly, also when this process makes no call."""

    def __init__(self, catalog: Catalog, failures: kvcore.OnceLogger) -> None:
        self._catalog = catalog
        self._failures = failures
        self._stop: threading.Event | None = None

    def watch(self, report: Callable[..., None] | None) -> set[str] | None:
        """Report to ``report`` from now on (None: stop reporting); the event kinds reported."""
        if self._stop is not None:  # stop the follower first: it reports
            self._stop.set()
            self._stop = None
        if report is None:
            self._catalog.report = None
            return None
        self._catalog.report_from_now(report)
        self._stop = stop = threading.Event()
        start_thread(lambda: self._follow(stop), "kv_file-events")
        return {ev.STORED, ev.REMOVED, ev.EVICTED}

    def close(self) -> None:
        """Stop the follower (the store is closing)."""
        if self._stop is not None:
            self._stop.set()

    def _follow(self, stop: threading.Event) -> None:
        while not stop.wait(FOLLOW_INTERVAL_S):
            try:
                self._catalog.sync()
            except Exception as exc:  # keep following; the next call applies what is left
                self._failures.warning(("follow", type(exc)), "kv_file events: %r", exc)
