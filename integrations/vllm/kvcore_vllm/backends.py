"""Opened kvcore backends, shared within a process and reopened after a failed start.

vLLM builds a scheduler-side and a worker-side connector. With one worker in the engine's
process (``distributed_executor_backend="uni"``) both live in one process: they share one
opened backend here, which is also what makes the in-process ``memory`` backend usable (its
data lives in the opened instance). Backends are reference-counted and closed with their last
user.

A backend that cannot be opened (a Mooncake master that is down, a disk that is not mounted)
does not stop the engine: the tier is a cache, so the connector runs with every lookup a miss,
logs the failure, counts it, and tries to open again after ``retry_s`` (0: never). Bad settings
(an unknown backend name, an invalid config) are not failures of the backend: they raise.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import kvcore
from kvcore.errors import KVCoreError

__all__ = ["BackendHandle"]

log = logging.getLogger("vllm.kvcore_vllm.backends")

_registry_lock = threading.Lock()
#: (name, config json, context json) -> [backend, users]
_registry: dict[tuple[str, str, str], list[Any]] = {}


def _registry_key(name: str, config: dict[str, Any], context: kvcore.BackendContext) -> tuple:
    return (name, json.dumps(config, sort_keys=True, default=str), context.model_dump_json())


def _acquire(name: str, config: dict[str, Any], context: kvcore.BackendContext) -> kvcore.Backend:
    key = _registry_key(name, config, context)
    with _registry_lock:
        entry = _registry.get(key)
        if entry is not None:
            entry[1] += 1
            return entry[0]
        backend = kvcore.open_backend(name, config, context=context)
        _registry[key] = [backend, 1]
        return backend


def _release(backend: kvcore.Backend) -> None:
    with _registry_lock:
        for key, entry in list(_registry.items()):
            if entry[0] is backend:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _registry[key]
                break
    backend.close()


class BackendHandle:
    """One backend for one (rank, world size) context, opened on first use."""

    def __init__(
        self,
        name: str,
        config: dict[str, Any],
        context: kvcore.BackendContext,
        *,
        retry_s: float = 30.0,
    ) -> None:
        self.name = name
        self.config = config
        self.context = context
        self.retry_s = retry_s
        self._backend: kvcore.Backend | None = None
        self._last_try = -float("inf")
        self._failures = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def open_failures(self) -> int:
        """How many times opening failed (a counter for the connector's stats)."""
        return self._failures

    def get(self) -> kvcore.Backend | None:
        """The opened backend, opening it if due; None while it cannot be opened."""
        backend = self._backend
        if backend is not None or self._closed:
            return backend
        with self._lock:
            if self._backend is not None or self._closed:
                return self._backend
            now = time.monotonic()
            waited = now - self._last_try
            if self._failures and (self.retry_s == 0 or waited < self.retry_s):
                return None
            self._last_try = now
            try:
                self._backend = _acquire(self.name, self.config, self.context)
            except KVCoreError:
                raise  # bad settings: the operator must fix them, retrying cannot
            except Exception as exc:
                self._failures += 1
                log.error(
                    "kvcore backend %r could not be opened (rank %d of %d): %s: %s; every "
                    "lookup is a miss until it opens (next try in %.0f s)",
                    self.name,
                    self.context.rank,
                    self.context.world_size,
                    type(exc).__name__,
                    exc,
                    self.retry_s,
                )
                return None
            if self._failures:
                log.info(
                    "kvcore backend %r opened after %d failed tries", self.name, self._failures
                )
            return self._backend

    def close(self) -> None:
        with self._lock:
            self._closed = True
            backend, self._backend = self._backend, None
        if backend is not None:
            _release(backend)
