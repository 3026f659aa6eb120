"""Puts made from threads at the lowest CPU priority, so waiting for one takes no engine core.

Mooncake's client waits for a transfer by polling its status without pause until it ends
(``TransferEngineOperationState::wait_for_completion`` in ``mooncake-store/src/
transfer_task.cpp`` loops on ``getTransferStatus``, in wheels built without
``USE_EVENT_DRIVEN_COMPLETION``, as the PyPI wheel 0.3.13 is). The bytes themselves move on the
client's transport thread; the thread that called the put does nothing but poll, and takes a
whole core for as long as the bytes take to cross the link. On a CPU engine that core is one
the model computes on.

Measured with vLLM's CPU engine on 2 cores (its OpenMP threads on both), behind a 490 Mbit/s
link: while the blocks of one 4,000-token prompt were being stored, the next prompt's time to
first token went from 0.30 s to 0.52-0.57 s, and to 0.81-0.83 s while two prompts' blocks were;
a profile of the worker showed both kvcore write threads inside that loop.

A put is background work: nobody waits for it but the engine's freeing of the blocks it
stores. So every put this backend makes runs on a thread of its own at the lowest CPU priority
(:func:`kvcore.threads.thread_pool` with ``background=True``): the caller's thread sleeps on
the answer, and the polling thread gets a core only when the engine does not need it.

Reads stay on the caller's thread, polled at its priority. That polling does slow the read
itself: it shares the cores with the client's transport thread and the store's sender. 8-block
reads on loopback (2 cores) took 2.64 ms polled by the caller, 2.04 ms from a lowest-priority
thread. On vLLM's CPU engine at 4 Gbit/s, a paced load of 124 blocks (about 20 calls) took
0.244-0.260 s against 0.217-0.246 s for one call of them all; made from a lowest-priority
thread, that request's TTFT matched the one call's (0.263 s against 0.262 s). But a read the
engine does not wait for (an asynchronous load while it computes) would starve at the
lowest priority: with both cores busy, 251 ms against 7.7 ms polled by the caller. Which reads
the engine waits for, only the core's read path knows; until it says, reads are polled here.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvcore.threads import thread_pool

__all__ = ["PUT_THREADS", "BackgroundPuts"]

#: Threads that make puts: at least as many as the callers that put at once (kvcore's write
#: lane has 2 by default, a tier stack's background copy one more), so no put waits for a
#: thread; a caller beyond them waits for the first to end, as it would for the client
PUT_THREADS = 8

T = TypeVar("T")


class BackgroundPuts:
    """Run a client's put calls on background-priority threads (see the module docstring)."""

    def __init__(self, threads: int = PUT_THREADS) -> None:
        self._pool: ThreadPoolExecutor = thread_pool(threads, "kv-mooncake-put", background=True)

    def call(self, put: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``put(*args, **kwargs)``, made from a background thread; its answer or its
        exception. Never abandoned: the client reads the caller's buffers until it answers."""
        return self._pool.submit(put, *args, **kwargs).result()

    def close(self) -> None:
        """Wait for the puts under way; later calls raise RuntimeError."""
        self._pool.shutdown(wait=True)
