"""The connector's backends: kvcore's handle (:class:`kvcore.BackendHandle`), shared and
reopened.

vLLM builds a scheduler-side and a worker-side connector. With one worker in the engine's
process (``distributed_executor_backend="uni"``) both live in one process: they share one
opened backend (``share=True``), which is also what makes the in-process ``memory`` backend
usable (its data lives in the opened instance). A backend that cannot be opened (a Mooncake
master that is down) does not stop the engine: every lookup is a miss until it opens again,
tried every ``reopen_interval_s``; bad settings raise. All of it is kvcore's handle; this
module only says how the connector uses it.
"""

from __future__ import annotations

from typing import Any

import kvcore

__all__ = ["connector_handle"]


def connector_handle(
    name: str | type,
    config: dict[str, Any],
    context: kvcore.BackendContext,
    *,
    retry_s: float,
    verify_blocks: str = "auto",
) -> kvcore.BackendHandle:
    """The handle of one (rank, world size) context's backend, shared within the process.
    ``verify_blocks`` is the connector's ``transfer.verify_blocks`` (the opened backend keeps
    the digests, for the scheduler's lookups and the worker's transfers alike)."""
    return kvcore.BackendHandle(
        name,
        config,
        context=context,
        retry_s=retry_s,
        share=True,
        verify_blocks=verify_blocks,  # type: ignore[arg-type]
    )
