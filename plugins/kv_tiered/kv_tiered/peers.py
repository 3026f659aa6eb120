"""What other processes sharing a stack's tiers changed, and what this stack does about it.

Two cases need it. A private tier (this process's memory) above a shared one (a kv_file
directory other processes use) would keep serving blocks another process removed. And a
background copy of this stack can land in a lower tier just after another process removed the
block from every tier. So the stack follows, through its events, each shared tier that has a
private tier above it or tiers below it: kv_file reports every change of its directory,
whoever makes it, and applies them before it answers a call.

- Removals and clears by peers reach the private tiers above (a lost event clears them).
  Evictions do not: an evicted block's copy is still the block.
- A block a peer removed from a shared tier is not served from the tiers below it, and is
  removed there, until someone stores it again.
- The stack's calls and its background copies both apply what peers did (a copy written into
  a shared tier is checked against its source after that, see :mod:`kv_tiered.mover`), so
  taking a tier's news and acting on it happens under one lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque

import kvcore
from kv_tiered.names import single_part_rows
from kv_tiered.tiers import Tiers
from kvcore import BlockRequest
from kvcore import events as ev
from kvcore.keys import ObjectName

__all__ = ["PeerChanges"]

#: objects of a followed tier's events queued before they collapse into one resync, and
#: names of blocks removed by peers kept
FOLLOW_QUEUE_OBJECTS = 1 << 16


class PeerChanges:
    """The followed tiers of one stack (see the module docstring)."""

    def __init__(self, tiers: Tiers, counters: kvcore.Counters, timeout_s: float) -> None:
        self._tiers = tiers
        self._counters = counters
        self._timeout_s = timeout_s
        caps = [t.capabilities for t in tiers]
        #: (tier, subscription, whether a private tier is above it)
        self._followed: list[tuple[int, ev.Subscription, bool]] = []
        #: tiers whose peers' removals this stack sees: private ones (no peers), and shared
        #: ones that report every change of theirs, whoever makes it (kv_file)
        self._seen = {j for j, c in enumerate(caps) if not c.shared}
        for j, tier in enumerate(tiers):
            private_above = any(not caps[i].shared for i in range(j))
            watches = tier.implements("kvcore_watch")
            if caps[j].shared and (private_above or j < len(tiers) - 1 or watches):
                sub = tier.events.subscribe(FOLLOW_QUEUE_OBJECTS)
                self._followed.append((j, sub, private_above))
                if watches:
                    self._seen.add(j)
        #: peers' removals as they were applied: (sequence number, object names; None for a
        #: clear), the newest FOLLOW_QUEUE_OBJECTS names' worth (see :meth:`removed_since`)
        self._removals: deque[tuple[int, frozenset[str] | None]] = deque()
        self._removal_names = 0
        self._removal_seq = 0
        #: first-part names of blocks peers removed from a followed tier with tiers below
        self._removed: OrderedDict[str, None] = OrderedDict()
        #: held while news is taken and applied, and while ``_removed`` is read or changed
        self._lock = threading.Lock()

    def before_call(self) -> None:
        """Before a call asks the tiers: a shared tier under a private one is asked first to
        apply what its peers did (an empty query), and that reaches the private tiers."""
        for j, sub, private_above in self._followed:
            if private_above:
                tier = self._tiers[j]
                tier.query(tier.request("tiered-follow", ()))
            self._take(j, sub)

    def catch_up(self) -> None:
        """Every followed tier applies what its peers did (an empty query each), and this
        stack takes it: a removal a peer made before now is in :meth:`removed_since`."""
        for j, sub, _ in self._followed:
            tier = self._tiers[j]
            tier.query(tier.request("tiered-follow", ()))
            self._take(j, sub)

    def after(self, i: int) -> None:
        """Tier ``i`` was just asked (and applied its peers' changes): take its news."""
        for j, sub, _ in self._followed:
            if j == i:
                self._take(j, sub)

    def not_removed(self, i: int, request: BlockRequest, run: int) -> int:
        """The part of tier ``i``'s leading ``run`` that no peer removed (the rest is removed
        from tier ``i`` and those below it)."""
        if not i or not run or not self._removed:
            return run
        names = request.object_names
        with self._lock:
            removed = self._removed
            first = next((k for k in range(run) if names[k][0] in removed), run)
        if first < run:
            stale = request.slice(first, run)
            for j in range(i, len(self._tiers)):
                self._tiers[j].remove(stale)
            self._counters.add("removed_by_peers_hidden_blocks", run - first)
        return first

    def sees_removals(self, i: int) -> bool:
        """Whether every removal of tier ``i``'s blocks by a peer reaches this stack."""
        return i in self._seen

    def removal_mark(self) -> int:
        """A point in the removals seen so far (for :meth:`removed_since`)."""
        with self._lock:
            return self._removal_seq

    def removed_since(self, mark: int) -> frozenset[str] | None:
        """Object names peers removed since ``mark``; None when that is not known name by
        name (a clear, a resync, or more removals than are kept): anything may be gone."""
        with self._lock:
            if self._removals and self._removals[0][0] > mark + 1:
                return None  # the oldest removals since the mark were dropped
            names: set[str] = set()
            for seq, removed in reversed(self._removals):
                if seq <= mark:
                    break
                if removed is None:
                    return None
                names |= removed
            return frozenset(names)

    def stored_again(self, request: BlockRequest) -> None:
        """This stack stores ``request``'s blocks: their copies are good again."""
        if self._removed:
            with self._lock:
                for names in request.object_names:
                    self._removed.pop(names[0], None)

    def _log_removal(self, names: frozenset[str] | None) -> None:
        """Record peers' removals (lock held)."""
        self._removal_seq += 1
        self._removals.append((self._removal_seq, names))
        self._removal_names += len(names or ()) + 1
        while self._removal_names > FOLLOW_QUEUE_OBJECTS and len(self._removals) > 1:
            _, dropped = self._removals.popleft()
            self._removal_names -= len(dropped or ()) + 1

    def close(self) -> None:
        for _, sub, _ in self._followed:
            sub.close()

    def _take(self, j: int, sub: ev.Subscription) -> None:
        # drained and applied as one step: a thread that finds the queue empty knows that
        # whatever was in it has been acted on
        with self._lock:
            events = sub.drain()
            if events:
                self._apply(j, events)

    def _apply(self, below: int, events: list[ev.StoreEvent]) -> None:
        tiers = self._tiers
        private = [tiers[i] for i in range(below) if not tiers[i].capabilities.shared]
        #: part -> the removed objects of that part (names, and each one's identity)
        gone: dict[str, tuple[list[str], list[ObjectName | None]]] = {}
        wipe = False
        removed = self._removed
        has_lower = below < len(tiers) - 1
        for event in events:
            if event.origin != ev.PEER and event.kind != ev.RESYNC:
                continue  # this stack's own changes reached every tier already
            if event.kind in (ev.CLEARED, ev.RESYNC):
                wipe = True
            elif event.kind == ev.REMOVED:
                for name, part, identity in zip(
                    event.names, event.parts, event.objects, strict=True
                ):
                    names, identities = gone.setdefault(part, ([], []))
                    names.append(name)
                    identities.append(identity)
                    if has_lower:
                        removed[name] = None
            elif event.kind == ev.STORED:  # stored again by a peer: its copies are good
                for name in event.names:
                    removed.pop(name, None)
        while len(removed) > FOLLOW_QUEUE_OBJECTS:
            removed.popitem(last=False)
        if wipe or gone:
            self._log_removal(None if wipe else frozenset(n for v, _ in gone.values() for n in v))
        for tier in private:
            if wipe:
                tier.clear()
                continue
            for part, (names, identities) in gone.items():
                # typed where the event knew the names' identity: the private tier's digests
                # of those blocks are found by it, and go with them
                for rows in single_part_rows(part, names, identities):
                    tier.remove(
                        BlockRequest(
                            task_id="tiered-invalidate",
                            block_keys=(),
                            object_names=rows,
                            parts=(part,),
                            deadline=time.monotonic() + self._timeout_s,
                            num_blocks=len(rows),
                        )
                    )
        self._counters.add("invalidations", sum(len(v) for v, _ in gone.values()) + wipe)
