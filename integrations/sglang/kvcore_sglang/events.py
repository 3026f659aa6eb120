"""The storage tier's KV events in SGLang's own format, on SGLang's own publisher.

SGLang 0.5.23 records KV events for its radix caches (GPU and host pages, ``StorageMedium.GPU``
and ``CPU_PINNED``) but gives a HiCache storage backend no event path: nothing records the L3
tier (``StorageMedium.DISK`` and ``EXTERNAL`` exist and are unused). So this module publishes
the storage tier's events itself, with SGLang's types and SGLang's ``ZmqEventPublisher``, on an
endpoint of its own (``events_endpoint`` in the storage extra config):

- ``BlockStored`` for a page once every part of it (K and V; MLA: the latent) is stored, named
  as SGLang names the page in its own events (``hash_str_to_int64`` of the page's key, the
  hash SGLang's HiCache passes to the storage tier), ``block_size`` = the page size;
- ``BlockRemoved`` for a page any part of which left the store (an eviction, a removal, another
  process's, where the kvcore backend reports them: kv_file does, see its README), only for a
  page it published as stored;
- ``AllBlocksCleared`` when the namespace was cleared or the stream fell behind;
- on attaching, what the store already holds (kvcore's listing subscription: listed after
  subscribing, so nothing in between is missed, for backends that list; listed again after
  the stream fell behind), ``_ATTACH_BATCH`` objects per publication: a storage attached to
  a shared store another process filled announces its pages before serving.

A stored page's ``BlockStored`` carries its token ids and its parent page's hash when the page
says them of itself (:mod:`kvcore_sglang.page_facts`: written with it as kvcore block metadata,
read back with :meth:`kvcore.Backend.describe`, so pages another process stored in a shared
store carry them too): a router index that hashes token ids itself (Dynamo's, llm-d's) places
it. A page without them (written before, by a backend that keeps no metadata, or whose tokens
SGLang's stack did not show) is published with its hash alone (``token_ids`` empty,
``parent_block_hash`` None), for a router that joins it with the GPU and host events. Pages
whose key is not a hash SGLang would publish (namespaced pages of a LoRA or a cache salt) are
published under that key's hash all the same; SGLang's events namespace those, so a router
will not match them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvcore import events as ev
from kvcore.threads import start_thread
from kvcore_sglang import page_facts
from kvcore_sglang.page_facts import PageFacts

__all__ = ["StorageEventPublisher"]

log = logging.getLogger("kvcore_sglang")

#: pages with some parts stored, waiting for the rest, at most (oldest forgotten first)
_MAX_PARTIAL = 100_000
#: how often the follower publishes what the store reported
_INTERVAL_S = 0.05
#: pages remembered as announced (removals are published only for those; past it the oldest
#: is withdrawn with a removal)
_MAX_ANNOUNCED = 200_000
#: listed objects announced per publication when attaching to a filled store
_ATTACH_BATCH = 8192


class StorageEventPublisher:
    """Follows a kvcore backend's event stream and publishes it as SGLang's KV events."""

    def __init__(
        self,
        backend: Any,
        parts: Sequence[str],
        page_size: int,
        endpoint: str,
        medium: str,
        topic: str = "",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        from sglang.srt.disaggregation.kv_events import StorageMedium, ZmqEventPublisher

        self.medium = StorageMedium(medium).value
        self.page_size = page_size
        self._backend = backend
        self._part_order = tuple(parts)
        self.parts = frozenset(parts)
        self.rank, self.world_size = rank, world_size
        self.namespace = backend.context.namespace
        self._publisher = ZmqEventPublisher(0, endpoint=endpoint, topic=topic)
        # the store's listing first, then its changes (kvcore lists it at the first flush)
        self._sub = backend.events.subscribe(listing=True, listing_batch=_ATTACH_BATCH)
        # this rank's pages from the store's object events (kvcore groups them)
        self._blocks = ev.RankBlocks(
            self.namespace, parts, rank, world_size, max_partial=_MAX_PARTIAL
        )
        self.published = 0
        self._announced: ev.Announced[str, str] = ev.Announced(_MAX_ANNOUNCED)  # pages told
        self._stop = threading.Event()
        self._thread = start_thread(self._follow, "kvcore-sglang-events")

    def _follow(self) -> None:
        while not self._stop.wait(_INTERVAL_S):
            self.flush()

    def flush(self) -> int:
        """Publish what the store reported since the last flush (the store's listing first,
        each batch of it published apart, then the stream's changes, which may remove what the
        listing held); returns how many events."""
        count = 0
        changes: list[ev.StoreEvent] = []
        for event in self._sub.drain():
            if event.origin == ev.LISTED:
                count += self._publish(self._translate(changes))
                changes = []
                count += self._publish(self._translate([event]))
            else:
                changes.append(event)
        return count + self._publish(self._translate(changes))

    def _publish(self, out: list[Any]) -> int:
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        if out:
            self._publisher.publish(KVEventBatch(ts=time.time(), events=out))
            self.published += len(out)
        return len(out)

    def _translate(self, events: Sequence[ev.StoreEvent]) -> list[Any]:
        """The store's events as SGLang's KV events."""
        from sglang.srt.disaggregation.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
        )
        from sglang.srt.mem_cache.utils import hash_str_to_int64

        out: list[Any] = []
        for event in events:
            stored: list[str] = []
            removed: list[int] = []
            announced = self._announced
            for change in self._blocks.changes(event):
                key = change.block_key
                if change.kind == ev.CLEARED:
                    announced.clear()
                    out.append(AllBlocksCleared())
                elif change.kind == ev.STORED:
                    if key not in announced:
                        stored.append(key)
                        withdrawn = announced.announce(key, key)  # past the bound: told gone
                        removed.extend(_page_hash(hash_str_to_int64, k) for k in withdrawn)
                elif announced.remove(key) is not None:  # never a removal of a page not told
                    removed.append(_page_hash(hash_str_to_int64, key))
            bare: list[int] = []
            for key, facts in _parents_first(stored, self._facts(stored)):
                if facts is None:
                    bare.append(_page_hash(hash_str_to_int64, key))
                    continue
                parent = (
                    None if facts.parent is None else _page_hash(hash_str_to_int64, facts.parent)
                )
                out.append(
                    BlockStored(
                        block_hashes=[_page_hash(hash_str_to_int64, key)],
                        parent_block_hash=parent,
                        token_ids=list(facts.tokens),
                        block_size=self.page_size,
                        lora_id=None,
                        medium=self.medium,
                    )
                )
            if bare:
                out.append(
                    BlockStored(
                        block_hashes=bare,
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=self.page_size,
                        lora_id=None,
                        medium=self.medium,
                    )
                )
            if removed:
                out.append(BlockRemoved(block_hashes=removed, medium=self.medium))
        return out

    def _facts(self, keys: list[str]) -> list[PageFacts | None]:
        """What each page says of itself (None: nothing, or the store could not say)."""
        if not keys or not self._backend.capabilities.block_meta:
            return [None] * len(keys)
        request = self._backend.request(
            "sglang-describe",
            keys,
            parts=self._part_order,
            rank=self.rank,
            world_size=self.world_size,
        )
        described = self._backend.describe(request)
        facts = [page_facts.decode(blob) for blob in described]
        if len(facts) != len(keys):  # a store that could not answer: counted by kvcore
            return [None] * len(keys)
        return facts

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.flush()
        self._sub.close()
        self._publisher.shutdown()


def _parents_first(
    keys: list[str], facts: list[PageFacts | None]
) -> list[tuple[str, PageFacts | None]]:
    """The pages in an order where a page whose parent is among them comes after it (a store
    listed by another process reports its pages in no particular order; an index places a
    page by its parent, so the parent must come first)."""
    of = dict(zip(keys, facts, strict=True))
    out: list[tuple[str, PageFacts | None]] = []
    done: set[str] = set()
    for key in keys:
        chain = []
        while key not in done:
            done.add(key)
            chain.append(key)
            facts = of[key]
            parent = None if facts is None else facts.parent
            if parent is None or parent not in of:
                break
            key = parent
        out.extend((k, of[k]) for k in reversed(chain))
    return out


def _page_hash(convert: Any, key: str) -> int:
    try:
        return convert(key)
    except ValueError:  # not a hex page hash: a stable hash of the key still names it
        import hashlib

        return convert(hashlib.sha256(key.encode()).hexdigest())
