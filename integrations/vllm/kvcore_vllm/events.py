"""KVCoreConnector's KV events: what the kvcore store gains and loses, as vLLM's ``BlockStored``,
``BlockRemoved`` and ``AllBlocksCleared`` (``medium`` = ``STORAGE``), published by vLLM's own
publisher when the engine has ``kv_events_config``.

Two halves, as vLLM splits a connector:

- each worker follows its backend's event stream (:mod:`kvcore.events`) and sends, with its
  step's output, what happened to its own rank's objects (:class:`WorkerEvents`): kv_file
  reports every change in its directory, evictions and other processes' included, so every
  rank's worker sees them; a backend that reports only what passes through it (``memory``,
  Mooncake) gives each worker its own writes and removals;
- the scheduler (:class:`SchedulerEvents`) knows vLLM's block hashes, token ids and parent
  hashes of the blocks it asked the workers to save: a block is announced ``BlockStored``
  (self-describing: its hash, parent hash, token ids and block size) once every rank stored
  its slice, ``BlockRemoved`` once any rank's slice left the store (an eviction, a removal,
  another process's), and a store that was cleared, or a stream that fell behind, is
  ``AllBlocksCleared``. Blocks a lookup finds stored (by another engine sharing the store, or
  before a restart) are announced when the lookup finds them: this engine can load them from
  then on, and it never tells of the removal of a block it did not announce.

Blocks are named by vLLM's own hashes (``maybe_convert_block_hash``), exactly as the engine's
GPU events name them, so an indexer places a stored block without seeing the GPU event. What
the scheduler no longer remembers (past ``max_known_blocks``; blocks other engines stored that
this one never looked up) cannot be named by vLLM's hash: those are counted
(``events_unmapped``), not guessed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)

from kvcore import events as ev

__all__ = ["BlockEvents", "SchedulerEvents", "WorkerEvents", "events_enabled"]

log = logging.getLogger("vllm.kvcore_vllm.events")

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
#: blocks whose vLLM hashes the scheduler remembers, to name them when they leave the store
DEFAULT_KNOWN_BLOCKS = 200_000


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
    """A worker's view of its backend's stream: this rank's blocks stored, or gone."""

    def __init__(
        self, backend: Any, ranks: Sequence[int], world_size: int, parts: Sequence[str]
    ) -> None:
        self.ranks = tuple(ranks)  # the slices this worker holds (one per KV head, per head)
        self.world_size = world_size
        self.namespace = backend.context.namespace
        self.parts = frozenset(parts)
        self._sub = backend.events.subscribe()
        # each slice's blocks from the store's object events (kvcore groups them)
        self._blocks = [
            ev.RankBlocks(self.namespace, parts, rank, world_size, max_partial=DEFAULT_KNOWN_BLOCKS)
            for rank in self.ranks
        ]

    def take(self) -> BlockEvents | None:
        records = [
            (change.kind, change.block_key, blocks.rank)
            for event in self._sub.drain()
            for blocks in self._blocks
            for change in blocks.changes(event)
        ]
        return BlockEvents(records) if records else None

    def close(self) -> None:
        self._sub.close()


@dataclass(slots=True)
class _Block:
    """What vLLM's ``BlockStored`` says of one block (as its GPU events say it)."""

    block_hash: Any
    parent_hash: Any
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None  # as vLLM's own events carry them
    ranks: set[int]


class SchedulerEvents:
    """The scheduler's half: vLLM's names for the blocks, and the events to publish.

    A block's vLLM hash is read from its own key (:meth:`RequestKeys.block_hash`): a key is
    made of the hash of exactly one request's block, so an event never names a block by a
    hash remembered from another request (another salt, adapter or image).
    """

    def __init__(
        self,
        world_size: int,
        block_size: int,
        request_keys: Any,
        max_known_blocks: int = DEFAULT_KNOWN_BLOCKS,
    ) -> None:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._convert = maybe_convert_block_hash
        self._keys = request_keys
        self.world_size = world_size
        self.block_size = block_size
        self.max_known = max_known_blocks
        self._pending: OrderedDict[str, _Block] = OrderedDict()  # asked to save, not all ranks
        self._stored: OrderedDict[str, Any] = OrderedDict()  # key -> vLLM hash, announced
        self._out: list[KVCacheEvent] = []
        self.unmapped = 0

    def _hash(self, key: str) -> Any:
        return self._convert(self._keys.block_hash(key))

    def _describe(
        self, request: Any, keys: Sequence[str], first_block: int
    ) -> list[tuple[str, _Block]]:
        """What an event says of blocks ``first_block ..`` of ``request`` (kvcore ``keys``),
        as vLLM's own events say it: hash, parent hash, token ids, adapter, extra keys."""
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            to_event_extra_keys,
        )

        tokens = request.all_token_ids
        bs = self.block_size
        lora = getattr(request, "lora_request", None)
        parent = (
            self._hash(self._keys.keys(request, first_block - 1, first_block)[0])
            if first_block > 0
            else None
        )
        out = []
        for offset, key in enumerate(keys):
            i = first_block + offset
            block_hash = self._hash(key)
            extra, _ = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)
            block = _Block(
                block_hash=block_hash,
                parent_hash=parent,
                token_ids=list(tokens[i * bs : (i + 1) * bs]),
                lora_id=lora.adapter_id if lora is not None else None,
                lora_name=lora.name if lora is not None else None,
                extra_keys=to_event_extra_keys([extra]),
                ranks=set(),
            )
            out.append((key, block))
            parent = block_hash
        return out

    def remember(self, request: Any, keys: Sequence[str], first_block: int) -> None:
        """Blocks ``first_block ..`` of ``request`` (kvcore ``keys``) are being saved: each is
        announced once every rank stored its slice."""
        for key, block in self._describe(request, keys, first_block):
            if key not in self._stored:
                self._pending[key] = block
                self._pending.move_to_end(key)
        while len(self._pending) > self.max_known:
            self._pending.popitem(last=False)

    def known(self, request: Any, keys: Sequence[str], first_block: int) -> None:
        """Blocks the lookup found stored for every rank (by another engine, or before a
        restart): this engine can load them, so it announces them now, and later tells of
        their removal. A block is never told removed by an engine that did not announce it."""
        for key, block in self._describe(request, keys, first_block):
            if key in self._stored:
                continue
            self._pending.pop(key, None)
            self._announce(block)
            self._remember_stored(key, block.block_hash)

    def receive(self, events: Any) -> None:
        """The workers' records of one step (a :class:`BlockEvents`)."""
        for kind, key, rank in events.get_all_events():
            if kind == STORED:
                block = self._pending.get(key)
                if block is None:
                    if key not in self._stored:
                        self.unmapped += 1
                    continue
                block.ranks.add(rank)
                if len(block.ranks) == self.world_size:
                    del self._pending[key]
                    self._announce(block)
                    self._remember_stored(key, block.block_hash)
            elif kind == REMOVED:
                block_hash = self._stored.pop(key, None)
                pending = self._pending.get(key)
                if pending is not None:
                    pending.ranks.discard(rank)
                if block_hash is None:
                    self.unmapped += pending is None
                    continue
                self._out.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_STORAGE))
            elif kind == CLEARED:
                self._stored.clear()
                for block in self._pending.values():
                    block.ranks.clear()
                self._out.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        out, self._out = self._out, []
        return out

    def _announce(self, block: _Block) -> None:
        self._out.append(
            BlockStored(
                block_hashes=[block.block_hash],
                parent_block_hash=block.parent_hash,
                token_ids=block.token_ids,
                block_size=self.block_size,
                lora_id=block.lora_id,
                medium=MEDIUM_STORAGE,
                lora_name=block.lora_name,
                extra_keys=block.extra_keys,
                group_idx=0,
            )
        )

    def _remember_stored(self, key: str, block_hash: Any) -> None:
        self._stored[key] = block_hash
        self._stored.move_to_end(key)
        while len(self._stored) > self.max_known:
            self._stored.popitem(last=False)
