"""vLLM's scheduler as the connector sees it: its own KV event publisher, for events the
connector sends between steps, and its waiting queue, for the load-or-recompute decision.

vLLM hands a connector no reference to its scheduler: it publishes what ``take_events``
returns, once per step. The store's events must also leave while the engine is idle (another
process stored or evicted blocks), so the connector finds the scheduler that is building it
(vLLM's ``Scheduler.__init__`` creates the connector, then its publisher) and publishes
through that publisher, whose ``publish`` is thread-safe (a queue its own thread drains): the
same socket, sequence numbers and replay buffer as the engine's own events. A synchronous
load holds up every request the engine has waiting, which the decision must count, and vLLM
asks it about one request at a time: the same scheduler's waiting queue says how many.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any

__all__ = ["EventPublisherRef"]

log = logging.getLogger("vllm.kvcore_vllm.publisher")

#: frames searched above the connector's constructor for vLLM's scheduler
_MAX_FRAMES = 24


class EventPublisherRef:
    """A weak reference to the vLLM scheduler building this connector: its publisher
    (:meth:`get`) and its waiting queue (:meth:`others_waiting`)."""

    def __init__(self, scheduler: Any | None) -> None:
        self._scheduler = weakref.ref(scheduler) if scheduler is not None else None

    @classmethod
    def of_calling_scheduler(cls) -> EventPublisherRef:
        """The scheduler among the callers (None found: events leave with the steps)."""
        from vllm.v1.core.sched.interface import SchedulerInterface

        frame = sys._getframe(1)
        for _ in range(_MAX_FRAMES):
            if frame is None:
                break
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, SchedulerInterface):
                return cls(candidate)
            frame = frame.f_back
        log.info(
            "KVCoreConnector: vLLM's scheduler not found among the callers; the store's "
            "events are published when the engine steps, and a load's decision does not see "
            "the requests waiting behind it"
        )
        return cls(None)

    def others_waiting(self) -> int:
        """Requests in the scheduler's waiting queues besides the one it is scheduling (vLLM
        asks the connector while the request is still at its queue's head; requests holding
        blocks wait in a queue of their own); 0 without a scheduler."""
        scheduler = self._scheduler() if self._scheduler is not None else None
        queues = [getattr(scheduler, name, None) for name in ("waiting", "kv_holding_waiting")]
        waiting = sum(len(queue) for queue in queues if queue is not None)
        return max(0, waiting - 1)

    def get(self) -> Any | None:
        """vLLM's publisher, once the scheduler has made it and while it runs; else None."""
        scheduler = self._scheduler() if self._scheduler is not None else None
        publisher = getattr(scheduler, "kv_event_publisher", None)
        if publisher is None or not getattr(publisher, "_running", True):
            return None
        return publisher
