"""Client calls made from threads at the lowest CPU priority: every put, and the reads a caller
waits for idle.

Mooncake's client waits for a transfer by polling its status without pause until it ends
(``TransferEngineOperationState::wait_for_completion`` in ``mooncake-store/src/
transfer_task.cpp`` loops on ``getTransferStatus``, in wheels built without
``USE_EVENT_DRIVEN_COMPLETION``, as the PyPI wheel 0.3.13 is). The bytes themselves move on the
client's transport thread; the thread that made the call does nothing but poll, and takes a
whole core for as long as the bytes take to cross the link.

**Puts** are background work: nobody waits for them but the engine's freeing of the blocks
they store. Measured with vLLM's CPU engine on 2 cores behind a 490 Mbit/s link: while one
4,000-token prompt's blocks were being stored by polling threads of normal priority, the next
prompt's time to first token went from 0.30 s to 0.52-0.57 s (0.81-0.83 s while two prompts'
were). So every put is made from a thread of its own at the lowest priority
(:func:`kvcore.threads.thread_pool` with ``background=True``): the caller's thread sleeps on
the answer, and the polling thread gets a core only when the engine does not need it.

**Reads** are polled where the request says the engine is (:attr:`kvcore.BlockRequest.
caller_idle`):

- the caller waits with nothing computing (a synchronous load, before the step's compute; a
  load-or-recompute probe between steps): from a lowest-priority thread. Polling at normal
  priority there takes cores from the transport thread and the store's sender and slows the
  read itself: 8-block reads on loopback (2 cores) took 2.64 ms polled by the caller and
  2.04 ms from a lowest-priority thread; on vLLM's CPU engine at 4 Gbit/s, a paced load of
  124 blocks (about 20 calls) took 0.244-0.260 s polled by the caller, against 0.217-0.246 s
  for one call of them all, and a lowest-priority poller brought that request's time to first
  token to the one call's (0.263 s against 0.262 s);
- otherwise (an asynchronous load the engine computes beside): on the caller's thread, at its
  priority. With both cores computing, the same read polled at the lowest priority took 251 ms,
  against 7.7 ms polled by the caller.

Reads and puts have pools of their own, so a read never queues behind puts.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvcore.threads import thread_pool

__all__ = ["PUT_THREADS", "READ_THREADS", "BackgroundCalls"]

#: Threads that make puts: at least as many as the callers that put at once (kvcore's write
#: lane has 2 by default, a tier stack's background copy one more), so no put waits for a
#: thread; a caller beyond them waits for the first to end, as it would for the client
PUT_THREADS = 8
#: Threads that make the reads callers wait for idle: as many as the callers that read at once
#: (a transfer manager's read workers, a runner's read lane), for the same reason
READ_THREADS = 8

T = TypeVar("T")


class BackgroundCalls:
    """Run a client's calls on ``threads`` background-priority threads named ``name``."""

    def __init__(self, threads: int, name: str) -> None:
        self._pool: ThreadPoolExecutor = thread_pool(threads, name, background=True)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, made from a background thread; its answer or its exception.
        Never abandoned: the client uses the caller's buffers until it answers."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """Wait for the calls under way; later calls raise RuntimeError."""
        self._pool.shutdown(wait=True)
