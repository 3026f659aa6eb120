"""The ``tiered`` backend: other kvcore backends, opened by name, stacked fastest first.

- **query**: the leading run over the union of the tiers, one batched call per tier: the first
  tier's leading run, then the next tier's from where it ended, and so on.
- **read**: each block from the first tier that holds it, in the same order; blocks that only
  a lower tier had are **promoted** into the tiers above it by a background copy (bounded
  queue, never past the read's deadline, nothing copied on the read's own path).
- **write** (``write-through``): acknowledged when the first tier that works stores it; the
  tiers below receive it by a background copy (bounded backlog, drops counted).
- **faults**: a tier that fails or misses its deadline is skipped for that call and counted
  (``tier<i>_failures``); the stack fails a call only when every tier did. A corrupt object
  is removed by the tier that finds it (kv_file verifies every read) and the block is read
  from the next tier that has it.
- **remove / clear** reach every tier, after the background copies of those blocks are
  cancelled or finished (what is removed is never copied back).

Each tier is a :class:`kvcore.Backend` opened with the stack's context, so it keeps its own
fault isolation, metrics and events. The stack declares only what every tier honours.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import kvcore
from kv_tiered.config import TieredConfig
from kv_tiered.mover import Copy, Mover
from kvcore import BlockRequest, HostBuffers, Outcome
from kvcore import events as ev
from kvcore.keys import parse_object_name
from kvcore.transfer.integrity import VerifiedBlocks

__all__ = ["TieredBackend"]

log = logging.getLogger("kvcore.tiered")

#: objects of a followed tier's events queued before they collapse into one resync
_FOLLOW_QUEUE_OBJECTS = 1 << 16


class TieredBackend:
    """An ordered stack of kvcore backends as one backend (see the module docstring)."""

    config_model = TieredConfig
    # the class's declaration; an opened stack declares what its tiers honour
    capabilities = kvcore.Capabilities(addressing="key", io="host", concurrent=True)

    def __init__(self, config: TieredConfig, context: kvcore.BackendContext) -> None:
        self.config = config
        self.context = context
        self.tiers: list[kvcore.Backend] = []
        try:
            for i, spec in enumerate(config.tiers):
                self.tiers.append(_open_tier(i, spec.backend, spec.config, context))
        except BaseException:
            self._close_tiers()
            raise
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
            # every tier's reads are verified: by the tier, or by the digests kept beside
            checksums=True,
        )
        self._counters = kvcore.Counters()
        #: shared tiers below a private one, followed through their events (see _follow)
        #: (tier, subscription, whether a private tier is above it)
        self._followed: list[tuple[int, ev.Subscription, bool]] = []
        for j, tier in enumerate(self.tiers):
            private_above = any(not caps[i].shared for i in range(j))
            tiers_below = j < len(self.tiers) - 1
            if caps[j].shared and (private_above or tiers_below):
                sub = tier.events.subscribe(_FOLLOW_QUEUE_OBJECTS)
                self._followed.append((j, sub, private_above))
        #: first-part names of blocks a peer removed from a shared tier with tiers below it
        #: (a copy of ours may land there after the removal): not served from below
        self._removed_by_peers: OrderedDict[str, None] = OrderedDict()
        #: tiers that keep no checksum of their own get block digests beside (kvcore's
        #: VerifiedBlocks), one wrapper per (tier, parts of a request)
        self._verified: dict[tuple[int, int], VerifiedBlocks] = {}
        self._mover = Mover(
            self._store,
            self._remove_from,
            self._part_bytes,
            max_blocks=config.backlog_blocks,
            threads=config.mover_threads,
            timeout_s=config.lower_timeout_s,
            counters=self._counters,
        )
        self._layout_parts = context.layout.parts if context.layout is not None else ()
        #: write-back-on-evict: blocks some of whose parts were evicted, waiting for the rest
        self._pending_evicted: OrderedDict[tuple, dict[str, tuple[str, bytes]]] = OrderedDict()
        self._write_through = config.write_policy == "write-through"
        if not self._write_through:
            try:
                self._hand_down_evictions()
            except BaseException:
                self._mover.close(0)
                self._close_tiers()
                raise
        log.info(
            "kv_tiered stack: %s, %s",
            " > ".join(t.name for t in self.tiers),
            config.write_policy,
        )

    # -- data --------------------------------------------------------------------------------

    @kvcore.hookimpl
    def kvcore_query(self, request: BlockRequest) -> int:
        self._follow()
        n = request.num_blocks
        found = 0
        failed = 0
        for i in range(len(self.tiers)):
            if found >= n:
                break
            part = request.slice(found, n)
            got = self._store(i, part).query(part)
            self._followed_after(i)
            failed += self._failed(i, "query", got)
            found += self._not_removed(i, part, int(got))
        return self._answer(found, n, failed, "query")

    @kvcore.hookimpl
    def kvcore_read(self, request: BlockRequest) -> int:
        host = request.host
        assert host is not None  # the core sends host buffers to io="host" backends
        self._follow()
        n = request.num_blocks
        done = 0
        failed = 0
        for i in range(len(self.tiers)):
            if done >= n or (i and request.expired()):
                break
            part = request.slice(done, n, host=host.slice(done, n))
            got = self._store(i, part).read(part)
            self._followed_after(i)
            failed += self._failed(i, "read", got)
            got = Outcome(self._not_removed(i, part, int(got)))
            if got:
                self._counters.add(f"tier{i}_read_blocks", int(got))
                if i and self.config.promote:
                    self._mover.submit(
                        Copy("promote", i, tuple(range(i)),
                             request.slice(done, done + got), request.deadline)
                    )  # fmt: skip
            done += int(got)
        return self._answer(done, n, failed, "read")

    @kvcore.hookimpl
    def kvcore_write(self, request: BlockRequest) -> int:
        n = request.num_blocks
        if self._removed_by_peers:  # stored again here: its copies are good again
            for names in request.object_names:
                self._removed_by_peers.pop(names[0], None)
        for i in range(len(self.tiers)):
            got = self._store(i, request).write(request)
            if got.failure is not None and got < n:
                self._failed(i, "write", got)
                continue  # this tier cannot take it now: the next one acknowledges
            self._counters.add(f"tier{i}_written_blocks", int(got))
            below = tuple(range(i + 1, len(self.tiers)))
            if got and below and self._write_through:
                self._mover.submit(Copy("lower", i, below, request.slice(0, got), None))
            return int(got)
        return Outcome(0, f"every tier failed to write ({len(self.tiers)} tiers)")

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
            got = self._remove_from(i, request)
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
    def kvcore_close(self) -> None:
        if not self._write_through:  # nothing handed down after the mover stops
            for tier in self.tiers[:-1]:
                tier.evict_to(None)
        for _, sub, _ in self._followed:
            sub.close()
        if not self._mover.close(self.config.lower_timeout_s):
            log.warning("kv_tiered: background copies still queued at close were dropped")
        self._close_tiers()

    def _not_removed(self, i: int, request: BlockRequest, run: int) -> int:
        """The part of a lower tier's leading ``run`` that no peer removed: a copy this stack
        made into tier ``i`` can land after a peer removed the block from every tier; it is
        cut from the run, and removed there."""
        tombstones = self._removed_by_peers
        if not i or not run or not tombstones:
            return run
        names = request.object_names
        for k in range(run):
            if names[k][0] in tombstones:
                stale = request.slice(k, run)
                for j in range(i, len(self.tiers)):
                    self._remove_from(j, stale)
                self._counters.add("removed_by_peers_hidden_blocks", run - k)
                return k
        return run

    def _remove_from(self, i: int, request: BlockRequest) -> Outcome:
        """Remove ``request``'s blocks from tier ``i`` (and their digests, where kept)."""
        tier = self.tiers[i]
        got = tier.remove(request)
        store = self._store(i, request)
        if isinstance(store, VerifiedBlocks) and request.num_blocks:
            tier.remove(store.digests_of(request))
        return got

    def _store(self, i: int, request: BlockRequest) -> kvcore.Backend | VerifiedBlocks:
        """What reads and writes tier ``i`` for ``request``: the tier itself when it verifies
        what it returns, else the tier with block digests beside."""
        tier = self.tiers[i]
        if tier.capabilities.checksums:
            return tier
        key = (i, len(request.parts))
        verified = self._verified.get(key)
        if verified is None:
            verified = self._verified[key] = VerifiedBlocks(tier, key[1])
        return verified

    def _hand_down_evictions(self) -> None:
        """write-back-on-evict: each tier that can hands what it evicts to the tier below it
        (the first tier must be able to: otherwise nothing would ever reach the others)."""
        if len(self.tiers) < 2:
            raise kvcore.ConfigError(
                "invalid config for backend 'tiered': write_policy 'write-back-on-evict' needs "
                "at least two tiers"
            )
        for i, tier in enumerate(self.tiers[:-1]):
            if not tier.evict_to(functools.partial(self._evicted, i)) and i == 0:
                raise kvcore.ConfigError(
                    f"invalid config for backend 'tiered': tiers[0] ({tier.name}) cannot hand "
                    "over what it evicts (kvcore_evict_to), which write_policy "
                    "'write-back-on-evict' needs (kv_file can)"
                )

    def _evicted(self, tier: int, objects: list[tuple[str, memoryview]]) -> None:
        """Objects tier ``tier`` evicts (their bytes valid during this call only), written to
        the tier below before this returns, and so before the tier deletes them: a block is
        never in neither tier.

        Objects are written a block at a time (the tier below may keep a digest per block):
        a block whose parts are evicted in different calls waits, copied, for its last part
        (at most ``backlog_blocks`` such blocks; past that the oldest is dropped, counted).
        """
        ready: list[dict[str, tuple[str, bytes]]] = []
        pending = self._pending_evicted
        for name, payload in objects:
            fields = parse_object_name(name)
            if fields is None or fields.namespace != self.context.namespace:
                ready.append({"": (name, bytes(payload))})  # not a block kvcore named: alone
                continue
            key = (fields.block_key, fields.rank, fields.world_size, fields.weight_version)
            parts = pending.setdefault(key, {})
            parts[fields.part] = (name, bytes(payload))
            layout_parts = self._layout_parts
            if fields.part not in layout_parts or set(parts) >= set(layout_parts):
                del pending[key]
                ready.append(parts)
        while len(pending) > self.config.backlog_blocks:
            _, dropped = pending.popitem(last=False)
            self._counters.add("evicted_lost_objects", len(dropped))
        for block in ready:
            self._write_evicted(tier + 1, block)

    def _write_evicted(self, below: int, block: dict[str, tuple[str, bytes]]) -> None:
        layout_parts = self._layout_parts
        parts = [p for p in layout_parts if p in block] if set(block) <= set(layout_parts) else []
        if len(parts) != len(block):
            parts = list(block)  # parts outside the layout: a block of its own
        names = tuple(block[p][0] for p in parts)
        fields = parse_object_name(names[0])
        buffers = [bytearray(block[p][1]) for p in parts]
        request = BlockRequest(
            task_id="tiered-evicted",
            block_keys=(fields.block_key,) if fields is not None else (),
            object_names=(names,),
            parts=tuple(parts),
            deadline=time.monotonic() + self.config.lower_timeout_s,
            host=HostBuffers(
                (tuple(_address(memoryview(b)) for b in buffers),), tuple(len(b) for b in buffers)
            ),
            num_blocks=1,
            part_nbytes=tuple(len(b) for b in buffers),
        )
        done = int(self._store(below, request).write(request))
        self._counters.add("evicted_written_objects", len(parts) * done)
        if not done:
            self._counters.add("evicted_lost_objects", len(parts))

    def _follow(self) -> None:
        """Keep private tiers (a process's memory) true to the shared tiers below them, and
        know what peers removed from shared tiers that have tiers below them.

        Another process sharing a lower tier may remove blocks this process holds a copy of
        above it (or clear the namespace). Before answering, each shared tier below a private
        one is asked to apply what its peers did (an empty query: kv_file reads its journal)
        and reports it as events; removals, clears and lost events then reach the private
        tiers above it. Evictions do not: an evicted block's copy is still the block. A shared
        tier with no private tier above reports its news when the call asks it anyway.
        """
        for j, sub, private_above in self._followed:
            if private_above:  # asked before the private tiers are: an empty call
                tier = self.tiers[j]
                tier.query(tier.request("tiered-follow", ()))
            self._take_events(j, sub)

    def _followed_after(self, i: int) -> None:
        """Tier ``i`` was just asked (and applied its peers' changes): take its news."""
        for j, sub, _ in self._followed:
            if j == i:
                self._take_events(j, sub)

    def _take_events(self, j: int, sub: ev.Subscription) -> None:
        events = sub.drain()
        if events:
            self._invalidate(j, events)

    def _invalidate(self, below: int, events: list[ev.StoreEvent]) -> None:
        private = [self.tiers[i] for i in range(below) if not self.tiers[i].capabilities.shared]
        gone: dict[str, list[str]] = {}
        wipe = False
        tombstones = self._removed_by_peers
        for event in events:
            if event.origin != ev.PEER and event.kind != ev.RESYNC:
                continue  # this stack's own changes reached every tier already
            if event.kind in (ev.CLEARED, ev.RESYNC):
                wipe = True
            elif event.kind == ev.REMOVED:
                for name, part in zip(event.names, event.parts, strict=True):
                    gone.setdefault(part, []).append(name)
                    if below < len(self.tiers) - 1:
                        tombstones[name] = None
            elif event.kind == ev.STORED:  # stored again by a peer: its copies are good
                for name in event.names:
                    tombstones.pop(name, None)
        while len(tombstones) > _FOLLOW_QUEUE_OBJECTS:
            tombstones.popitem(last=False)
        for tier in private:
            if wipe:
                tier.clear()
                continue
            for part, names in gone.items():
                tier.remove(
                    BlockRequest(
                        task_id="tiered-invalidate",
                        block_keys=(),
                        object_names=tuple((n,) for n in names),
                        parts=(part,),
                        deadline=time.monotonic() + self.config.default_timeout_s,
                        num_blocks=len(names),
                    )
                )
        self._counters.add("invalidations", sum(len(v) for v in gone.values()) + wipe)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued background copy ran (tests, benchmarks, shutdown)."""
        return self._mover.drain(timeout_s)

    # -- plumbing ----------------------------------------------------------------------------

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

    def _part_bytes(self, request: BlockRequest) -> Sequence[int] | None:
        if request.part_nbytes is not None:
            return request.part_nbytes
        layout = self.context.layout
        if layout is None:
            return None
        return [layout.part_bytes(p) for p in request.parts]

    def _close_tiers(self) -> None:
        for tier in reversed(self.tiers):
            try:
                tier.close()
            except Exception as exc:  # closing the others matters more
                log.warning("kv_tiered: closing tier %r failed: %s", tier.name, exc)


def _address(view: memoryview) -> int:
    """Where a (writable, contiguous) payload's bytes are."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _open_tier(
    index: int, name: str, config: dict, context: kvcore.BackendContext
) -> kvcore.Backend:
    """Open tier ``index``; an error names it (``tiers[1] (mooncake): ...``)."""
    where = f"tiers[{index}] ({name})"
    try:
        tier = kvcore.open_backend(name, config, context=context)
    except kvcore.ConfigError as exc:
        raise kvcore.ConfigError(f"invalid config for backend 'tiered': {where}: {exc}") from None
    except kvcore.KVCoreError:
        raise
    except Exception as exc:
        raise kvcore.ConfigError(
            f"backend 'tiered': {where} cannot open: {type(exc).__name__}: {exc}"
        ) from exc
    caps = tier.capabilities
    if caps.addressing != "key" or caps.io != "host" or caps.token_index:
        tier.close()
        raise kvcore.ConfigError(
            f"invalid config for backend 'tiered': {where} is {caps.addressing}-addressed with "
            f"{caps.io} I/O; a stack takes key-addressed, host-I/O backends"
        )
    return tier
