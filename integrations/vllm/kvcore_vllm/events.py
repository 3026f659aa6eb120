"""KVCoreConnector's KV events: what the kvcore store gains and loses, as vLLM's ``BlockStored``,
``BlockRemoved`` and ``AllBlocksCleared`` (``medium`` = ``STORAGE``), published by vLLM's own
publisher when the engine has ``kv_events_config``.

Where the store's changes are seen:

- a backend whose stream describes the whole store (kv_file: every process's writes,
  removals, evictions and clears; :attr:`kvcore.Backend.reports_whole_store`) is followed by
  the scheduler itself (:class:`StoreFollower`): a thread that publishes within
  ``events_interval_s`` whether or not the engine steps, so an idle engine still tells a
  router what it can load and what left;
- otherwise (``memory``, Mooncake: each client reports what passes through it) each worker
  follows its backend's stream and sends, with its step's output, what happened to its own
  rank's objects (:class:`WorkerEvents`).

The scheduler (:class:`SchedulerEvents`) names blocks by vLLM's own hashes
(``maybe_convert_block_hash``), exactly as the engine's GPU events name them, with their
parent hashes, token ids, adapter and extra keys, so an indexer places a stored block without
seeing a GPU event:

- blocks it asked the workers to save are announced once every rank stored its slice;
- blocks another process stored (another engine sharing the store, this one before a
  restart) are named by what they say of themselves: every block the connector saves carries
  a descriptor (:mod:`kvcore_vllm.descriptors`, kvcore's block metadata), read back with
  :meth:`kvcore.Backend.describe` and trusted only when its hash is the one its key was made
  from (a block of another scope, salt or adapter never matches: it is not this engine's to
  load). Blocks without one (written before descriptors, or by a backend that keeps none)
  are counted (``events_unmapped``), never guessed; a lookup that finds them still
  announces them;
- ``BlockRemoved`` once any rank's slice left the store, only for a block this engine
  announced; a cleared store, or a stream that fell behind, is ``AllBlocksCleared``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventBatch,
)

from kvcore import OnceLogger
from kvcore import events as ev
from kvcore_vllm.descriptors import BlockDescriber, BlockFacts, decode

__all__ = ["BlockEvents", "SchedulerEvents", "StoreFollower", "WorkerEvents", "events_enabled"]

log = logging.getLogger("vllm.kvcore_vllm.events")

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
#: blocks whose vLLM hashes the scheduler remembers, to name them when they leave the store
DEFAULT_KNOWN_BLOCKS = 200_000
#: blocks of other processes whose descriptors one round of the follower reads at most
DESCRIBED_PER_ROUND = 20_000


def events_enabled(vllm_config: Any) -> bool:
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


class BlockEvents(KVConnectorKVEvents):
    """What workers send the scheduler: ``(kind, block key, rank)`` records, in order."""

    def __init__(self, records: list[tuple[str, str, int]] | None = None) -> None:
        self.records = list(records or [])
        self._workers = 1

    def add_events(self, events: list[Any]) -> None:
        self.records.extend(events)

    def aggregate(self) -> BlockEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.records)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self.records.clear()

    def __repr__(self) -> str:
        return f"<BlockEvents {len(self.records)} records from {self._workers} workers>"


class WorkerEvents:
    """A worker's view of its backend's stream: this rank's blocks stored, or gone.

    Nothing to send when the backend's stream describes the whole store (kv_file): the
    scheduler then follows the store itself (:class:`StoreFollower`), in real time."""

    def __init__(
        self, backend: Any, ranks: Sequence[int], world_size: int, parts: Sequence[str]
    ) -> None:
        self.ranks = tuple(ranks)  # the slices this worker holds (one per KV head, per head)
        self.world_size = world_size
        self.namespace = backend.context.namespace
        self.parts = frozenset(parts)
        self._sub: ev.Subscription | None = backend.events.subscribe()
        if backend.reports_whole_store:
            self._sub.close()
            self._sub = None
        # each slice's blocks from the store's object events (kvcore groups them)
        self._blocks = [
            ev.RankBlocks(
                self.namespace,
                parts,
                rank,
                world_size,
                weight_version=backend.weight_version,
                max_partial=DEFAULT_KNOWN_BLOCKS,
            )
            for rank in self.ranks
        ]

    def take(self) -> BlockEvents | None:
        if self._sub is None:
            return None
        records = [
            (change.kind, change.block_key, blocks.rank)
            for event in self._sub.drain()
            for blocks in self._blocks
            for change in blocks.changes(event)
        ]
        return BlockEvents(records) if records else None

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close()


class SchedulerEvents:
    """The scheduler's half: vLLM's names for the blocks, and the events to publish.

    A block's vLLM hash is read from its own key (:meth:`BlockDescriber.block_hash`): a key is
    made of the hash of exactly one request's block, so an event never names a block by a
    hash remembered from another request (another salt, adapter or image). Blocks another
    process stored are named by what they say of themselves (their descriptor, read from the
    store), checked against their key the same way.

    Thread-safe: the scheduler's step and the :class:`StoreFollower` both call it.
    """

    def __init__(
        self,
        world_size: int,
        describer: BlockDescriber,
        max_known_blocks: int = DEFAULT_KNOWN_BLOCKS,
    ) -> None:
        self.describer = describer
        self.world_size = world_size
        self.max_known = max_known_blocks
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()  # asked to save, not all ranks
        self._stored: ev.Announced[str, Any] = ev.Announced(max_known_blocks)  # -> vLLM hash
        #: blocks stored by others, by rank, not yet complete or not yet described
        self._unnamed: OrderedDict[str, set[int]] = OrderedDict()
        self._to_describe: OrderedDict[str, None] = OrderedDict()  # complete, to be read
        self._out: list[KVCacheEvent] = []
        #: set while a follower publishes: the step then takes nothing (one publishing path,
        #: so a removal is never published before the store it follows)
        self.published_elsewhere = False
        self.unmapped = 0  # blocks stored by others that could not be named (no descriptor)

    def remember(self, described: Sequence[tuple[str, BlockFacts]]) -> None:
        """Blocks being saved (kvcore keys with their facts): each is announced once every
        rank stored its slice."""
        with self._lock:
            for key, facts in described:
                if key not in self._stored:
                    self._pending[key] = _Pending(facts)
                    self._pending.move_to_end(key)
            while len(self._pending) > self.max_known:
                self._pending.popitem(last=False)

    def known(self, described: Sequence[tuple[str, BlockFacts]]) -> None:
        """Blocks the lookup found stored for every rank (by another engine, or before a
        restart): this engine can load them, so it announces them now, and later tells of
        their removal. A block is never told removed by an engine that did not announce it."""
        with self._lock:
            for key, facts in described:
                if key not in self._stored:
                    self._pending.pop(key, None)
                    self._forget_unnamed(key)
                    self._announce(key, facts)

    def receive(self, events: Any) -> None:
        """The workers' records of one step (a :class:`BlockEvents`)."""
        self.receive_records(events.get_all_events())

    def receive_records(self, records: Sequence[tuple[str, str, int]]) -> None:
        """``(kind, block key, rank)`` records, in order."""
        with self._lock:
            for kind, key, rank in records:
                if kind == STORED:
                    self._stored_slice(key, rank)
                elif kind == REMOVED:
                    self._removed_slice(key, rank)
                elif kind == CLEARED:
                    self._stored.clear()  # AllBlocksCleared below tells of every one
                    self._unnamed.clear()
                    self._to_describe.clear()
                    for block in self._pending.values():
                        block.ranks.clear()
                    self._out.append(AllBlocksCleared())

    def _stored_slice(self, key: str, rank: int) -> None:
        if key in self._stored:
            return
        block = self._pending.get(key)
        if block is not None:
            block.ranks.add(rank)
            if len(block.ranks) == self.world_size:
                del self._pending[key]
                self._announce(key, block.facts)
            return
        ranks = self._unnamed.setdefault(key, set())  # another process's: read what it says
        ranks.add(rank)
        if len(ranks) == self.world_size:
            del self._unnamed[key]
            self._to_describe[key] = None
        elif len(self._unnamed) > self.max_known:
            self._unnamed.popitem(last=False)

    def _removed_slice(self, key: str, rank: int) -> None:
        pending = self._pending.get(key)
        if pending is not None:
            pending.ranks.discard(rank)
        self._forget_unnamed(key)
        block_hash = self._stored.remove(key)
        if block_hash is not None:  # only what this engine announced
            self._out.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_STORAGE))

    def _forget_unnamed(self, key: str) -> None:
        self._unnamed.pop(key, None)
        self._to_describe.pop(key, None)

    def waiting(self) -> int:
        """Blocks stored by others, complete, not yet described."""
        with self._lock:
            return len(self._to_describe)

    def to_describe(self, limit: int) -> list[str]:
        """Up to ``limit`` blocks every rank of which another process stored, to be named by
        their descriptors (:meth:`described`), oldest first."""
        with self._lock:
            return list(itertools.islice(self._to_describe, limit))

    def described(self, keys: Sequence[str], metas: Sequence[bytes | None]) -> None:
        """What the store says of ``keys`` (:meth:`kvcore.Backend.describe`): each block whose
        descriptor is its own is announced; one without (written before descriptors, or by a
        writer that keeps none) or with another's is counted, never announced."""
        with self._lock:
            for key, meta in zip(keys, metas, strict=True):
                if key not in self._to_describe:
                    continue  # removed or cleared meanwhile
                del self._to_describe[key]
                facts = None if meta is None else decode(meta)
                if facts is None or not self.describer.matches(key, facts):
                    self.unmapped += 1
                    continue
                self._announce(key, facts)

    def take(self, *, publisher: bool = False) -> list[KVCacheEvent]:
        """The events to publish, once: the follower's (``publisher=True``) while it
        publishes, else the step's."""
        with self._lock:
            if self.published_elsewhere != publisher:
                return []
            out, self._out = self._out, []
            return out

    def _announce(self, key: str, facts: BlockFacts) -> None:
        self._out.append(
            BlockStored(
                block_hashes=[facts.block_hash],
                parent_block_hash=facts.parent_hash,
                token_ids=facts.token_ids,
                block_size=facts.block_size,
                lora_id=facts.lora_id,
                medium=MEDIUM_STORAGE,
                lora_name=facts.lora_name,
                extra_keys=facts.extra_keys,
                group_idx=0,
            )
        )
        # a block this engine can no longer follow is withdrawn, never left credited
        for forgotten in self._stored.announce(key, facts.block_hash):
            self._out.append(BlockRemoved(block_hashes=[forgotten], medium=MEDIUM_STORAGE))


@dataclass(slots=True)
class _Pending:
    """A block being saved: its facts, and the ranks that stored their slice so far."""

    facts: BlockFacts
    ranks: set[int] = field(default_factory=set)


class StoreFollower:
    """The scheduler's own view of the store, published in real time.

    A thread owned by the connector: every ``interval_s`` it reads what the scheduler's
    backend reports of the store (kv_file reports every process's changes), names the blocks
    other processes stored from their descriptors (:meth:`kvcore.Backend.describe`, in calls
    of ``describe_batch`` blocks, at most ``describe_per_round`` per round), and publishes the
    events through vLLM's own publisher, whether or not the engine steps: an idle engine
    still tells a router what it can load and what left. Its subscription starts with the
    store's listing (kvcore's ``subscribe(listing=True)``): a new engine announces what it
    finds.
    """

    def __init__(
        self,
        events: SchedulerEvents,
        backend: Any,
        slices: Sequence[tuple[int, int]],
        parts: Sequence[str],
        publisher_of: Callable[[], Any],
        *,
        interval_s: float,
        describe_batch: int = 4096,
        describe_per_round: int = DESCRIBED_PER_ROUND,
    ) -> None:
        self.events = events
        self._backend = backend
        self._slices = list(slices)  # (rank, world) of every slice a block is stored as
        self._publisher_of = publisher_of
        self.interval_s = interval_s
        self._batch = describe_batch
        self._per_round = describe_per_round
        self._logged_listing = False
        # the store's listing first (taken after subscribing: no change is missed), then its
        # changes; listed again after a resync
        self._sub = backend.events.subscribe(listing=True)
        self._blocks = [
            ev.RankBlocks(
                backend.context.namespace,
                parts,
                rank,
                world,
                weight_version=backend.weight_version,
                max_partial=DEFAULT_KNOWN_BLOCKS,
            )
            for rank, world in self._slices
        ]
        self.follows_store = backend.reports_whole_store
        self._stop = threading.Event()
        self._failures = OnceLogger(log)
        self._thread: threading.Thread | None = None
        if self.follows_store:
            self._thread = threading.Thread(
                target=self._run, name="kvcore-vllm-events", daemon=True
            )
            self._thread.start()
        else:  # the workers' records say what this rank's backend sees: nothing to follow
            self._sub.close()

    def _receive(self, store_events: Sequence[ev.StoreEvent]) -> None:
        records = [
            (change.kind, change.block_key, blocks.rank)
            for event in store_events
            for blocks in self._blocks
            for change in blocks.changes(event)
        ]
        if records:
            self.events.receive_records(records)

    def round(self) -> None:
        """One round: the store's changes, the descriptors of new blocks (at most
        ``describe_per_round``: a large store is announced over several rounds, its changes
        published between them), the publication."""
        self._receive(self._sub.drain())
        if not self._logged_listing:
            self._logged_listing = True
            log.info(
                "KVCoreConnector: the store holds %d objects; %d blocks of this engine's "
                "scope to announce",
                self._sub.listed,
                self.events.waiting(),
            )
        described = 0
        while described < self._per_round and not self._stop.is_set():
            keys = self.events.to_describe(min(self._batch, self._per_round - described))
            if not keys:
                break
            rank, world = self._slices[0]
            request = self._backend.request(
                "kvcore-vllm/describe", keys, rank=rank, world_size=world
            )
            self.events.described(keys, self._backend.describe(request))
            described += len(keys)
        publisher = self._publisher_of()
        # without vLLM's publisher (not found) the events leave with the engine's next step
        self.events.published_elsewhere = publisher is not None
        out = self.events.take(publisher=True)
        if out and publisher is not None:
            with contextlib.suppress(RuntimeError):  # closed meanwhile: the engine is stopping
                publisher.publish(KVEventBatch(ts=time.time(), events=out))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.round()
            except Exception as exc:  # keep following: a failed round is retried next time
                self._failures.warning(
                    ("round", type(exc)), "KVCoreConnector: store events round failed: %r", exc
                )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sub.close()
