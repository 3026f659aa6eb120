"""What the stack reports on its event stream beyond what kvcore sees (``kvcore_watch``).

kvcore publishes the stack's own writes, removals and clears. What it cannot see is a block
leaving the stack for capacity: a router indexing the stack's events would list it forever.
A block leaves the stack when its last tier evicts it (a tier above hands what it evicts to
the tier below first, :mod:`kv_tiered.evictions`) and no tier above holds it any more (a
write-through stack keeps recent blocks in its first tier too). So the stack follows its
last tier's events and reports those evictions, objects still held above left out. A last
tier that reports no evictions (Mooncake) gives the stack none to report.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kv_tiered.names import single_part_rows
from kv_tiered.tiers import Tiers
from kvcore import BlockRequest
from kvcore import events as ev
from kvcore.keys import ObjectName
from kvcore.threads import start_thread

__all__ = ["StackEvictions"]

log = logging.getLogger("kvcore.tiered")

#: objects of the last tier's events queued before they collapse into one resync
QUEUE_OBJECTS = 1 << 16
#: how often evictions made outside the stack's writes (a peer's, a rescan's) are reported
_IDLE_PUMP_S = 0.2


class StackEvictions:
    """Reports the stack's evictions to ``report`` until :meth:`close` (see the module
    docstring)."""

    def __init__(self, tiers: Tiers, report: Callable[..., None], timeout_s: float) -> None:
        self._tiers = tiers
        self._report = report
        self._timeout_s = timeout_s
        last = tiers[len(tiers) - 1]
        self._sub = last.events.subscribe(QUEUE_OBJECTS)
        self._lock = threading.Lock()  # one pump at a time: events keep their order
        self._stop = threading.Event()
        self._thread = start_thread(self._follow, "kv_tiered-events")

    def pump(self) -> None:
        """Report what the last tier evicted so far (each stack write ends with this, so its
        evictions are on the stream when it returns; a thread does it while idle)."""
        with self._lock:
            for event in self._sub.drain():
                try:
                    self._handle(event)
                except Exception as exc:  # keep reporting; this batch is lost: say so
                    log.warning("kv_tiered: reporting the stack's evictions failed: %r", exc)
                    self._report(ev.RESYNC, [])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close()

    def _follow(self) -> None:
        while not self._stop.wait(_IDLE_PUMP_S):
            self.pump()

    def _handle(self, event: ev.StoreEvent) -> None:
        if event.kind == ev.RESYNC:
            self._report(ev.RESYNC, [])
            return
        if event.kind != ev.EVICTED or not event.names:
            return
        left = [
            (name, size, part)
            for name, size, part, identity in zip(
                event.names, event.sizes, event.parts, event.objects, strict=True
            )
            if not self._held_above(name, part, identity)
        ]
        if left:
            self._report(
                ev.EVICTED,
                [n for n, _, _ in left],
                [s for _, s, _ in left],
                event.origin,
                tenant=event.tenant,
            )

    def _held_above(self, name: str, part: str, identity: ObjectName | None) -> bool:
        """Whether a tier above the last one holds the object ``name``."""
        # typed when the event knew its identity: a tier that keeps digests beside its blocks
        # (kvcore.integrity) finds this object's by it, and holds the object only with them
        (rows,) = single_part_rows(part, [name], [identity])
        request = BlockRequest(
            task_id="tiered-events",
            block_keys=(),
            object_names=rows,
            parts=(part,),
            deadline=time.monotonic() + self._timeout_s,
            num_blocks=1,
        )
        return any(self._tiers[i].query(request) for i in range(len(self._tiers) - 1))
