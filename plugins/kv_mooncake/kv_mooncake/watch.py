"""Every change of a shared Mooncake store, whoever made it: the backend's event stream when it
can list the store (``master_metrics_port``).

Mooncake tells a client nothing of what other clients store or remove, or of what its master
evicts. So while the stream is followed (``kvcore_watch``):

- this client's writes, removals and clears are reported as it makes them (origin local);
- everything else is found by listing the store (:class:`~kv_mooncake.listing.StoreListing`)
  every ``interval_s`` and comparing the listing with what is known: objects that appeared are
  stored, objects that went are removed (origin peer; a listing cannot tell another client's
  removal from the master's eviction, and a consumer treats both as gone).

A change is therefore reported within one interval and one listing. The listing lists every
key of the cluster (~0.85 ms per 1,000 keys on the master, the same again to parse here), so
the interval stretches to five times the last listing's duration: following a large store
costs at most a fifth of a core, and its changes arrive later (100,000 keys: about 0.6 s).

Names this client touched while a listing was in flight are left to the next round (the
listing may predate the change), and so are names whose change this client is making
(:meth:`StoreWatch.changing`: a listing taken between the store's answer and the change's own
report would take it for another client's, and the report, finding it known, would say
nothing: seen on a busy machine as a local removal reported as a peer's). A round during which
this client cleared the namespace is not compared at all.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import kvcore
from kv_mooncake.listing import StoreListing
from kvcore import events as ev
from kvcore.threads import start_thread

__all__ = ["LISTING_SHARE", "StoreWatch"]

log = logging.getLogger("kvcore.mooncake")

#: the interval is at least this many times the last listing's duration
LISTING_SHARE = 5.0


class StoreWatch:
    """The whole store's changes, reported through kvcore's ``report`` callable."""

    def __init__(
        self,
        listing: StoreListing,
        interval_s: float,
        counters: kvcore.Counters,
        warnings: kvcore.OnceLogger,
    ) -> None:
        self._listing = listing
        self._interval_s = interval_s
        self._counters = counters
        self._warnings = warnings
        self._lock = threading.Lock()
        self._report: Callable[..., None] | None = None
        self._known: set[str] = set()
        self._seeded = False
        self._touched: set[str] | None = None  # names changed here during a listing
        self._changing: Counter[str] = Counter()  # names whose change here is under way
        self._cleared_during = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- kvcore_watch ------------------------------------------------------------------------

    def watch(self, report: Callable[..., None] | None) -> set[str] | None:
        self._end_thread()
        with self._lock:
            self._report = report
            self._known.clear()
            self._seeded = False
        if report is None:
            return None
        # what is stored now is known without being reported: a follower lists the store
        # itself after subscribing; changes from here on are reported. A master that does
        # not answer now leaves nothing known: the first listing that succeeds later reports
        # everything in it as stored (the follower's own listing failed too, and what peers
        # stored meanwhile must reach it), never becomes a silent seed
        self._round()
        with self._lock:
            self._seeded = True
        self._stop.clear()
        self._thread = start_thread(self._run, "kv-mooncake-watch")
        return {ev.STORED, ev.REMOVED, ev.CLEARED}

    def close(self) -> None:
        self.watch(None)

    @property
    def active(self) -> bool:
        """Whether somebody follows the stream (else this client's changes need no report)."""
        return self._report is not None

    # -- this client's changes ---------------------------------------------------------------

    @contextlib.contextmanager
    def changing(self, names: Collection[str]) -> Iterator[None]:
        """Around a change of ``names`` in the store and its report (:meth:`stored`,
        :meth:`removed`): no listing round reports them meanwhile (see the module docstring)."""
        with self._lock:
            self._changing.update(names)
        try:
            yield
        finally:
            with self._lock:
                self._changing.subtract(names)
                self._changing = +self._changing  # drop the names no change holds any more
                self._touch(names)

    def stored(self, names: Sequence[str], sizes: Sequence[int]) -> None:
        with self._lock:
            if self._report is None:
                return
            new = [(n, s) for n, s in zip(names, sizes, strict=True) if n not in self._known]
            if not new:
                return
            self._known.update(n for n, _ in new)
            self._touch(n for n, _ in new)
            self._report(ev.STORED, [n for n, _ in new], [s for _, s in new], ev.LOCAL)

    def removed(self, names: Collection[str]) -> None:
        with self._lock:
            if self._report is None:
                return
            gone = [n for n in names if n in self._known]
            self._known.difference_update(gone)
            self._touch(names)
            if gone:
                self._report(ev.REMOVED, gone, None, ev.LOCAL)

    def cleared(self) -> None:
        with self._lock:
            if self._report is None:
                return
            self._known.clear()
            self._cleared_during = self._touched is not None
            self._report(ev.CLEARED, [], None, ev.LOCAL)

    def _touch(self, names: Any) -> None:
        if self._touched is not None:
            self._touched.update(names)

    # -- other clients' changes --------------------------------------------------------------

    def _run(self) -> None:
        delay = self._interval_s
        while not self._stop.wait(delay):
            took = self._round()
            delay = max(self._interval_s, LISTING_SHARE * took)

    def _round(self) -> float:
        """List the store once and report what changed since the last listing; the listing's
        duration."""
        with self._lock:
            self._touched = set()
            self._cleared_during = False
        start = time.monotonic()
        try:
            listed = set(self._listing.names().values())
        except Exception as exc:  # a master that does not answer: try again next round
            self._counters.add("watch_listing_failed")
            self._warnings.warning(
                ("watch", type(exc).__name__),
                "mooncake: listing the store at %s failed (%s); other clients' changes are "
                "reported once it answers again, what they stored meanwhile included (further "
                "failures logged at debug level)",
                self._listing.url,
                exc,
            )
            with self._lock:
                self._touched = None
            return time.monotonic() - start
        took = time.monotonic() - start
        self._counters.add("watch_listings")
        with self._lock:
            touched, self._touched = self._touched or set(), None
            report = self._report
            if report is None:
                return took
            if not self._seeded:
                self._known |= listed
                self._seeded = True
                return took
            if self._cleared_during:
                return took  # the listing may hold what the clear removed: next round
            skip = touched | self._changing.keys()
            added = [n for n in listed - self._known if n not in skip]
            gone = [n for n in self._known - listed if n not in skip]
            self._known.update(added)
            self._known.difference_update(gone)
            if added:
                report(ev.STORED, added, None, ev.PEER)
            if gone:
                report(ev.REMOVED, gone, None, ev.PEER)
        return took

    def _end_thread(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            if thread is not threading.current_thread():
                thread.join()
