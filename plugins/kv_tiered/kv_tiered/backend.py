"""The ``tiered`` backend: other kvcore backends, opened by name, stacked fastest first.

- **query**: the leading run over the union of the tiers, one batched call per tier: the first
  tier's leading run, then the next tier's from where it ended, and so on.
- **read**: each block from the first tier that holds it, in the same order; blocks that only
  a lower tier had are **promoted** into the tiers above it by a background copy (bounded
  queue, never past the read's deadline) of the bytes the read already has: copied once out
  of the caller's buffers on the read's path (a memcpy), so the lower tier is not read twice.
- **write**: acknowledged when the first tier that works stores it; with ``write-through``
  the tiers below receive it by a background copy (bounded backlog, drops counted), with
  ``write-back-on-evict`` a tier below receives what the tier above evicts
  (:mod:`kv_tiered.evictions`).
- **faults**: a tier that fails or misses its deadline is skipped for that call and counted
  (``tier<i>_failures``); the stack fails a call only when every tier did. A corrupt object
  is removed by the tier that finds it (kv_file verifies every read) and the block is read
  from the next tier that has it.
- **remove / clear** reach every tier, after the background copies of those blocks are
  cancelled or finished (what is removed is never copied back).

Each tier is a :class:`kvcore.Backend` opened with the stack's context, so it keeps its own
fault isolation, metrics and events (:mod:`kv_tiered.tiers`: tiers without checksums get
block digests). Other processes sharing the tiers are followed (:mod:`kv_tiered.peers`);
background copies run in :mod:`kv_tiered.mover`. The stack declares what every tier honours.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import kvcore
from kv_tiered.activity import Activity
from kv_tiered.bounded import BoundedCalls, Missed
from kv_tiered.buffers import private_copy
from kv_tiered.config import TieredConfig
from kv_tiered.evictions import EvictionHandDown
from kv_tiered.mover import Copy, Mover
from kv_tiered.peers import PeerChanges
from kv_tiered.stack_events import StackEvictions
from kv_tiered.tiers import Tiers
from kvcore import BlockRequest, FailureKind, HostBuffers, Outcome

__all__ = ["TieredBackend"]


def _next_tier(i: int, served: int) -> int:
    """The tier to ask after tier ``i`` served ``served`` blocks of a run: the next one, or,
    after a lower tier served, the first again. Evictions hand blocks down one by one and
    write-through copies only the leading run its source still has, so one run's blocks may
    alternate between tiers (0-1 below, 2-7 above); each tier is asked from where the run
    stands until none has the next block. A run held by one tier costs one call per tier."""
    return 0 if served and i else i + 1


def host_of(request: BlockRequest, n: int) -> HostBuffers | None:
    """The host buffers of ``request``'s first ``n`` blocks."""
    return None if request.host is None else request.host.slice(0, n)


log = logging.getLogger("kvcore.tiered")


class TieredBackend:
    """An ordered stack of kvcore backends as one backend (see the module docstring)."""

    config_model = TieredConfig
    # the class's declaration; an opened stack declares what its tiers honour
    capabilities = kvcore.Capabilities(addressing="key", io="host", concurrent=True)

    def __init__(self, config: TieredConfig, context: kvcore.BackendContext) -> None:
        self.config = config
        self.context = context
        self.tiers = Tiers(config.tiers, context)
        caps = [t.capabilities for t in self.tiers]
        self.capabilities = kvcore.Capabilities(
            addressing="key",
            io="host",
            # a block acknowledged is in the first tier: what it promises, the stack does
            # (persistence too: closing waits for the copies into the tiers below)
            persistent=any(c.persistent for c in caps),
            shared=caps[0].shared,
            scales=all(c.scales for c in caps),
            concurrent=True,
            segmented_host=all(c.segmented_host for c in caps),
            # every read is verified: by the tier, or by the digests its facade keeps beside
            checksums=True,
            # a block's metadata, where the first tier (the one a write acknowledges) keeps it;
            # the tiers below keep what their copies carry
            block_meta=caps[0].block_meta,
        )
        self._counters = kvcore.Counters()
        self._peers = PeerChanges(self.tiers, self._counters, config.default_timeout_s)
        self._activity = Activity()
        self._mover = Mover(
            self.tiers,
            self.tiers.part_bytes,
            self._peers,
            max_blocks=config.backlog_blocks,
            threads=config.mover_threads,
            timeout_s=config.lower_timeout_s,
            counters=self._counters,
            activity=self._activity,
            max_yield_s=config.copy_yield_s,
        )
        self._write_through = config.write_policy == "write-through"
        self._stack_events: StackEvictions | None = None
        #: calls into each tier on a caller's path that return by its deadline (tier 0 is
        #: called directly: its own deadline handling is what the caller asked for)
        self._calls = [BoundedCalls(f"tier{i}") for i in range(len(self.tiers))]
        try:
            self._evictions = EvictionHandDown(
                self.tiers,
                self._calls,
                self._counters,
                timeout_s=config.lower_timeout_s,
                required=not self._write_through,
            )
        except BaseException:
            self._mover.close(0)
            self._peers.close()
            self.tiers.close()
            raise
        log.info(
            "kv_tiered stack: %s, %s",
            " > ".join(t.name for t in self.tiers),
            config.write_policy,
        )

    # -- data --------------------------------------------------------------------------------

    @kvcore.hookimpl
    def kvcore_query(self, request: BlockRequest) -> int:
        self._peers.before_call()
        n = request.num_blocks
        found = 0
        failed: set[int] = set()
        i = 0
        while i < len(self.tiers) and found < n:
            part = request.slice(found, n)
            got = self._call(i, "query", part, None)
            self._peers.after(i)
            if self._failed(i, "query", got):
                failed.add(i)
            served = self._peers.not_removed(i, part, int(got))
            found += served
            i = _next_tier(i, served)
        return self._answer(found, n, len(failed), "query")

    @kvcore.hookimpl
    def kvcore_read(self, request: BlockRequest) -> int:
        with self._activity:
            return self._read(request)

    def _read(self, request: BlockRequest) -> int:
        host = request.host
        assert host is not None  # the core sends host buffers to io="host" backends
        self._peers.before_call()
        n = request.num_blocks
        done = 0
        failed: set[int] = set()
        i = 0
        calls = 0
        while i < len(self.tiers) and done < n:
            if calls and request.expired():
                break
            calls += 1
            mark = self._peers.removal_mark() if i and self.config.promote else None
            part = request.slice(done, n, host=host.slice(done, n))
            # straight into the caller's buffers, never abandoned (see _call): the tier's own
            # deadline handling bounds it (kv_mooncake abandons its existence checks)
            got = self.tiers[i].read(part)
            self._peers.after(i)
            if self._failed(i, "read", got):
                failed.add(i)
            served = self._peers.not_removed(i, part, int(got))
            if served:
                self._counters.add(f"tier{i}_read_blocks", served)
                if mark is not None and self._mover.has_room(served):
                    self._promote(i, request.slice(done, done + served), part.host, mark)
            done += served
            i = _next_tier(i, served)
        return self._answer(done, n, len(failed), "read")

    def _promote(self, source: int, blocks: BlockRequest, read_into: HostBuffers | None,
                 mark: int) -> None:  # fmt: skip
        """Queue the promotion of ``blocks``, which tier ``source`` just read into the leading
        blocks of ``read_into``: their bytes are copied now, before the caller may reuse its
        buffers, so the copy needs no second read of the source."""
        assert read_into is not None
        payload = private_copy(read_into.slice(0, blocks.num_blocks))
        copy = Copy("promote", source, tuple(range(source)), blocks, blocks.deadline,
                    payload=payload, removal_mark=mark)  # fmt: skip
        self._mover.submit(copy)

    @kvcore.hookimpl
    def kvcore_write(self, request: BlockRequest) -> int:
        with self._activity:
            return self._write(request)

    def _write(self, request: BlockRequest) -> int:
        n = request.num_blocks
        self._peers.stored_again(request)
        for i in range(len(self.tiers)):
            if i and request.expired():
                break
            got = self._call(i, "write", request, request.host)
            if got.failure is not None and got < n:
                self._failed(i, "write", got)
                continue  # this tier cannot take it now: the next one acknowledges
            done = int(got)
            self._counters.add(f"tier{i}_written_blocks", done)
            below = tuple(range(i + 1, len(self.tiers)))
            if done and below and self._write_through:
                durable = self._durable_below(i)
                if durable is not None:  # acknowledged once it would survive a crash
                    done = self._write_durably(
                        durable, request.slice(0, done, host=host_of(request, done))
                    )
                    below = tuple(t for t in below if t != durable)
                if done and below:
                    self._mover.submit(Copy("lower", i, below, request.slice(0, done), None))
            if self._stack_events is not None:
                self._stack_events.pump()
            return done
        return Outcome(0, f"no tier stored the blocks by the deadline ({len(self.tiers)} tiers)")

    @kvcore.hookimpl
    def kvcore_describe(self, request: BlockRequest) -> list[bytes | None]:
        """Each block's metadata from the first tier that has it (tiers that keep none, or
        fail, answer None: the next one is asked for what is still unknown)."""
        found: list[bytes | None] = [None] * request.num_blocks
        for tier in self.tiers:
            missing = [i for i, meta in enumerate(found) if meta is None]
            if not missing or not tier.capabilities.block_meta:
                continue
            lo, hi = missing[0], missing[-1] + 1
            for i, meta in enumerate(tier.describe(request.slice(lo, hi)), start=lo):
                if found[i] is None:
                    found[i] = meta
        return found

    @kvcore.hookimpl
    def kvcore_names(self) -> list[str]:
        """What any tier holds, each name once (tiers that cannot list contribute none)."""
        return list(dict.fromkeys(name for tier in self.tiers for name in tier.names()))

    @kvcore.hookimpl
    def kvcore_admit(self, request: BlockRequest) -> int:
        """The first tier decides what the stack takes (it is the one a write fills)."""
        return int(self.tiers[0].admit(request))

    @kvcore.hookimpl
    def kvcore_remove(self, request: BlockRequest) -> int:
        self._mover.forget({names[0] for names in request.object_names})
        removed = 0
        failure = None
        for i, tier in enumerate(self.tiers):
            got = tier.remove(request)
            if got.failure is not None and tier.implements("kvcore_remove"):
                self._failed(i, "remove", got)
                failure = failure or got.failure
            removed = max(removed, int(got))
        return removed if failure is None else Outcome(removed, failure)

    @kvcore.hookimpl
    def kvcore_clear(self) -> int:
        self._mover.forget(None)
        cleared = 0
        failure = None
        for i, tier in enumerate(self.tiers):
            got = tier.clear()
            if got.failure is not None and tier.implements("kvcore_clear"):
                self._failed(i, "clear", got)
                failure = failure or got.failure
            cleared += int(got)
        return cleared if failure is None else Outcome(cleared, failure)

    @kvcore.hookimpl
    def kvcore_clear_tenant(self, tenant: str) -> int:
        """Every object of ``tenant`` removed from every tier (see ``kvcore_clear_tenant``):
        each tier's own clear of a tenant; a tier that cannot clear one makes the answer a
        failure naming it, of the first failing tier's kind (``unsupported`` where it has no
        such hook): the other tiers are cleared still."""
        self._mover.forget(None, tenant)
        cleared = 0
        failure: Outcome | None = None
        unknown: list[str] = []  # tiers that never held the tenant: fine while another did
        for i, tier in enumerate(self.tiers):
            got = tier.clear(tenant=tenant)
            if got.kind is FailureKind.UNKNOWN_TENANT:
                unknown.append(got.failure or "")
            elif got.failure is not None:
                if tier.implements("kvcore_clear_tenant"):
                    self._failed(i, "clear_tenant", got)
                failure = failure or Outcome(0, f"tier {i} ({tier.name}): {got.failure}", got.kind)
            cleared += int(got)
        if failure is None and len(unknown) == len(self.tiers):
            return Outcome(cleared, unknown[0], FailureKind.UNKNOWN_TENANT)
        return cleared if failure is None else Outcome(cleared, failure.failure, failure.kind)

    # -- lifecycle ---------------------------------------------------------------------------

    @kvcore.hookimpl
    def kvcore_register_buffer(self, ptr: int, nbytes: int) -> None:
        for tier in self.tiers:
            tier.register_buffer(ptr, nbytes)

    @kvcore.hookimpl
    def kvcore_unregister_buffer(self, ptr: int) -> None:
        for tier in self.tiers:
            tier.unregister_buffer(ptr)

    @kvcore.hookimpl
    def kvcore_stats(self) -> dict[str, float]:
        out = self._counters.snapshot()
        out["backlog_blocks"] = float(self._mover.backlog_blocks)
        out["tiers"] = float(len(self.tiers))
        for i, tier in enumerate(self.tiers):
            for name, value in tier.stats().items():
                if name.startswith("backend_"):
                    out[f"tier{i}_{name.removeprefix('backend_')}"] = value
        return out

    @kvcore.hookimpl
    def kvcore_watch(self, report: Callable[..., None] | None) -> set[str] | None:
        """Report blocks leaving the stack for capacity (:mod:`kv_tiered.stack_events`);
        kvcore publishes the stack's own writes, removals and clears."""
        if self._stack_events is not None:
            self._stack_events.close()
            self._stack_events = None
        if report is not None:
            self._stack_events = StackEvictions(self.tiers, report, self.config.default_timeout_s)
        return None

    @kvcore.hookimpl
    def kvcore_close(self) -> None:
        if self._stack_events is not None:
            self._stack_events.close()
        self._evictions.detach()  # evictions while closing are plain ones
        self._peers.close()
        if not self._mover.close(self.config.lower_timeout_s):
            log.warning("kv_tiered: background copies still queued at close were dropped")
        for calls in self._calls:
            calls.close()
        self.tiers.close()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued background copy ran, and report the evictions made so far
        on the event stream (tests, benchmarks, shutdown)."""
        drained = self._mover.drain(timeout_s)
        if self._stack_events is not None:
            self._stack_events.pump()
        return drained

    # -- plumbing ----------------------------------------------------------------------------

    def _durable_below(self, i: int) -> int | None:
        """For a persistent stack whose tier ``i`` is not: the first persistent tier below it,
        which a write-through write reaches before it is acknowledged (else a crash would
        lose what only tier ``i`` held). None where tier ``i`` is persistent itself."""
        if self.tiers[i].capabilities.persistent or not self.capabilities.persistent:
            return None
        return next(
            j for j in range(i + 1, len(self.tiers)) if self.tiers[j].capabilities.persistent
        )

    def _write_durably(self, j: int, request: BlockRequest) -> int:
        """Write ``request`` to tier ``j`` by its deadline; the leading blocks it stored."""
        got = self._call(j, "write", request, request.host)
        self._failed(j, "write", got)
        self._counters.add(f"tier{j}_written_blocks", int(got))
        return int(got)

    def _call(self, i: int, op: str, request: BlockRequest, host: HostBuffers | None) -> Outcome:
        """``op`` (query or write) on tier ``i``; below the first tier, bounded by the
        request's deadline (:mod:`kv_tiered.bounded`). An abandoned call may still run after
        the caller returned, so a write below the first tier goes from a copy of the caller's
        buffers. Reads are not made here: one into buffers of the stack's own, copied over
        if it returned in time, measured 0.09x kv_file alone for a first read from Mooncake
        against 0.21x straight into the engine's registered buffers."""
        if op not in ("query", "write"):
            raise ValueError(f"no such tier call: {op!r}")
        if i == 0:
            return getattr(self.tiers[i], op)(request)
        own = None
        if host is not None:
            copy, own = private_copy(host)
            request = replace(request, host=copy)
        run = functools.partial(getattr(self.tiers[i], op), request)
        try:
            return self._calls[i].call(run, request.deadline, keep=own)
        except Missed as exc:
            late = time.monotonic() >= request.deadline
            return Outcome(0, str(exc), FailureKind.DEADLINE if late else None)

    def _failed(self, tier: int, op: str, outcome: Outcome) -> int:
        """Count a tier's failure (1) or nothing (0); the tier logged it once itself."""
        if outcome.failure is None:
            return 0
        self._counters.add(f"tier{tier}_failures")
        self._counters.add(f"tier{tier}_failures_{op}")
        return 1

    def _answer(self, count: int, n: int, failed: int, op: str) -> int:
        """The count; a failure only when every tier failed (a short answer, not a miss)."""
        if failed and failed == len(self.tiers) and count < n:
            return Outcome(count, f"every tier failed to {op}")
        return count
