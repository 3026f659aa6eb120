"""Background copies between the tiers of a stack: promotions (a lower tier's blocks into the
tiers above it, after a read found them there) and write-through (an acknowledged write's
blocks into the tiers below the one that acknowledged it).

A write-through copy reads the blocks back from its source tier into buffers of its own and
writes them to its targets: the write that caused it copies nothing and waits for nothing. A
promotion comes with the bytes the read already has (:attr:`Copy.payload`, verified by the
read, copied once out of the caller's buffers): the source tier is not read again. The queue
is bounded in blocks; a copy that does not fit, or whose deadline passed while it waited, is
dropped and counted (a later miss in that tier, never an error).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import kvcore
from kv_tiered.activity import Activity
from kv_tiered.buffers import Region, own_buffers
from kv_tiered.names import take
from kv_tiered.peers import PeerChanges
from kvcore import BlockRequest, HostBuffers
from kvcore.threads import start_thread

__all__ = ["Copy", "Mover"]

log = logging.getLogger("kvcore.tiered")


@dataclass(frozen=True)
class Copy:
    """Blocks of ``request`` (names only, no buffers) to copy from tier ``source`` to
    ``targets``; ``kind`` names the counters (``promote`` or ``lower``)."""

    kind: str
    source: int
    targets: tuple[int, ...]
    request: BlockRequest
    #: a ``time.monotonic()`` instant after which the copy is not started; None: its own
    #: timeout from when it starts
    deadline: float | None
    #: the blocks' bytes, already read (and verified) from the source, in buffers of the
    #: stack's own (the mmap keeps them); None: the copy reads the source itself
    payload: tuple[HostBuffers, Region] | None = None
    #: the peers' removals seen before the source was read (:meth:`PeerChanges.removal_mark`);
    #: None: taken when the copy reads the source
    removal_mark: int | None = None

    @property
    def blocks(self) -> int:
        return self.request.num_blocks


class Mover:
    """Runs :class:`Copy` jobs on ``threads`` threads (see the module docstring).

    :param store: what reads and writes tier ``i`` for a request (the tier, or it with block
        digests beside).
    :param part_bytes: bytes of each part of a request's objects.
    :param peers: what other processes sharing the tiers changed: applied after a copy is
        written and before it is checked against what they removed meanwhile.
    """

    def __init__(
        self,
        tiers: Sequence[kvcore.Backend],
        part_bytes: Callable[[BlockRequest], Sequence[int] | None],
        peers: PeerChanges,
        *,
        max_blocks: int,
        threads: int,
        timeout_s: float,
        counters: kvcore.Counters,
        activity: Activity | None = None,
        max_yield_s: float = 0.0,
    ) -> None:
        self._tiers = tiers  # each verifies its blocks itself (kvcore.integrity)
        self._activity = activity
        self._max_yield_s = max_yield_s
        self._part_bytes = part_bytes
        self._peers = peers
        self._max_blocks = max_blocks
        self._timeout_s = timeout_s
        self._counters = counters
        self._queue: deque[Copy] = deque()
        self._queued_blocks = 0
        self._active = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._threads = [start_thread(self._work, f"kv_tiered-mover-{i}") for i in range(threads)]

    def has_room(self, blocks: int) -> bool:
        """Whether ``blocks`` more would fit in the queue now (so a caller copies bytes for a
        copy only when it is likely to be taken)."""
        with self._cond:
            return not self._stopping and self._queued_blocks + blocks <= self._max_blocks

    def submit(self, copy: Copy) -> bool:
        """Queue ``copy``; False (and counted as dropped) when the backlog is full or closed."""
        n = copy.blocks
        if n <= 0:
            return True
        with self._cond:
            if self._stopping or self._queued_blocks + n > self._max_blocks:
                self._counters.add(f"{copy.kind}_dropped_blocks", n)
                return False
            self._queue.append(copy)
            self._queued_blocks += n
            self._counters.add(f"{copy.kind}_queued_blocks", n)
            self._cond.notify()
        return True

    def forget(self, names: set[str] | None, tenant: str | None = None) -> None:
        """Drop queued copies of blocks named in ``names`` (all, for None; with ``tenant``,
        those of requests of that tenant) and wait for the running ones: what is removed must
        not be copied back afterwards."""
        with self._cond:
            kept: deque[Copy] = deque()
            for copy in self._queue:
                rows = copy.request.object_names
                if tenant is not None:
                    keep = [] if copy.request.tenant == tenant else list(range(copy.blocks))
                elif names is None:
                    keep = []
                else:
                    keep = [i for i, b in enumerate(rows) if b[0] not in names]
                if len(keep) < copy.blocks:
                    self._queued_blocks -= copy.blocks - len(keep)
                    self._counters.add(f"{copy.kind}_cancelled_blocks", copy.blocks - len(keep))
                    if not keep:
                        continue
                    request = copy.request
                    payload = copy.payload
                    if payload is not None:  # the kept blocks' bytes, in the same region
                        host, region = payload
                        kept_ptrs = tuple(host.ptrs[i] for i in keep)
                        payload = (HostBuffers(kept_ptrs, host.nbytes), region)
                    copy = replace(copy, payload=payload, request=take(request, keep))
                kept.append(copy)
            self._queue = kept
            while self._active:
                self._cond.wait()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued copy ran; False if that took longer than ``timeout_s``."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._active:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    @property
    def backlog_blocks(self) -> int:
        return self._queued_blocks

    def close(self, timeout_s: float) -> bool:
        """Run what is queued (up to ``timeout_s``), then stop; True if nothing was left."""
        drained = self.drain(timeout_s)
        with self._cond:
            self._stopping = True
            if not drained:
                for copy in self._queue:
                    self._counters.add(f"{copy.kind}_dropped_blocks", copy.blocks)
                self._queue.clear()
                self._queued_blocks = 0
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=max(1.0, timeout_s))
        return drained

    # -- the threads ---------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                copy = self._queue.popleft()
                self._queued_blocks -= copy.blocks
                self._active += 1
            try:
                self._run(copy)
            except Exception as exc:  # a copy is best-effort: never let it kill the thread
                self._counters.add(f"{copy.kind}_failed_blocks", copy.blocks)
                log.warning("kv_tiered: a background %s copy failed: %s", copy.kind, exc)
            finally:
                with self._cond:
                    self._active -= 1
                    self._cond.notify_all()

    def _run(self, copy: Copy) -> None:
        kind, n = copy.kind, copy.blocks
        now = time.monotonic()
        if copy.deadline is not None and now >= copy.deadline:
            self._counters.add(f"{kind}_expired_blocks", n)
            return
        sizes = self._part_bytes(copy.request)
        if sizes is None:
            self._counters.add(f"{kind}_failed_blocks", n)
            return
        if self._activity is not None and self._max_yield_s > 0:
            # the callers first (kv_tiered.activity): a copy runs in their pauses
            until = now + self._max_yield_s
            if copy.deadline is not None:
                until = min(until, copy.deadline)
            if not self._activity.wait_quiet(until):
                self._counters.add(f"{kind}_unyielded_blocks", n)
            now = time.monotonic()
            if copy.deadline is not None and now >= copy.deadline:
                self._counters.add(f"{kind}_expired_blocks", n)
                return
        deadline = copy.deadline if copy.deadline is not None else now + self._timeout_s
        if copy.payload is not None:  # the bytes the caller's read verified: no second read
            host, region = copy.payload
            mark = copy.removal_mark if copy.removal_mark is not None else -1
            request = replace(copy.request, host=host, deadline=deadline)
            got = n
        else:
            mark = self._peers.removal_mark()  # before the read: removals from here on count
            host, region = own_buffers(n, sizes)  # the region lives until this copy returns
            request = replace(copy.request, host=host, deadline=deadline)
            got = int(self._tiers[copy.source].read(request))
            if got < n:
                self._counters.add(f"{kind}_source_missing_blocks", n - got)
            if not got:
                return
        part = request.slice(0, got, host=host.slice(0, got))
        for target in copy.targets:
            done = int(self._tiers[target].write(part))
            self._counters.add(f"{kind}_copied_blocks", done)
            if done < got:
                self._counters.add(f"{kind}_failed_blocks", got - done)
        del region
        # A block removed from the source while it was being copied (by another process
        # sharing the tiers) must not live on in the targets: whoever removed it may already
        # have removed it there. Peers' removals are applied first (a private source learns
        # of a removal from a shared tier only then), so one made while this copy was queued
        # or running is never undone by the copy landing after it. Where the stack sees every
        # removal of the source's blocks by peers, exactly the copies of removed blocks are
        # undone: a block the source merely evicted meanwhile keeps its copy (the copy is
        # what keeps it). Elsewhere (a Mooncake source reports no peer's changes), the copies
        # of blocks the source no longer holds are undone, evicted or removed alike.
        self._peers.catch_up()
        if self._peers.sees_removals(copy.source):
            removed = self._peers.removed_since(mark)
            rows = part.object_names
            gone = [i for i in range(got) if removed is None or not removed.isdisjoint(rows[i])]
        else:
            still = int(self._tiers[copy.source].query(part))
            gone = list(range(still, got))
        if gone:
            undo = take(part, gone)
            for target in copy.targets:
                self._tiers[target].remove(undo)
            self._counters.add(f"{kind}_undone_blocks", len(gone))
