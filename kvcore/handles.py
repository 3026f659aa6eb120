"""One way to open a backend: a handle that opens, shares, reopens and checks capabilities.

Every caller that opens a backend by name - the transfer manager, the engine adapters, a tier
stack, replay, the CLI - goes through :class:`BackendHandle`, so the policies are the same
everywhere:

- **settings errors raise** (:class:`~kvcore.errors.KVCoreError`: an unknown name, a bad
  config, a missing capability): retrying cannot fix them;
- **a backend that fails to open** (a Mooncake master that is down, a disk not mounted) either
  raises at once (:meth:`BackendHandle.open`, for a caller that cannot run without it: a CLI
  command, a replay) or leaves the handle closed for ``retry_s`` (:meth:`BackendHandle.get`
  returns None, the caller counts a miss and asks again later: an engine's cache tier must not
  stop the engine), on one schedule, logged once per failure;
- **sharing within a process** (``share=True``): handles with the same name, config, context
  and ``verify_blocks`` share one opened backend, closed with its last user (vLLM's scheduler
  and worker connectors in one process; the in-process ``memory`` backend only works shared);
- **capabilities** a caller needs (``requires``) are checked once, here, when the backend opens.

.. versionadded:: 0.3
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from kvcore.backend import Backend, VerifyBlocks
from kvcore.errors import ConfigError, KVCoreError
from kvcore.registry import open_backend
from kvcore.schemas import BackendContext

__all__ = ["BackendHandle", "opened_backends", "require_capabilities"]

log = logging.getLogger("kvcore.handles")

_shared_lock = threading.Lock()
#: sharing key -> [backend, users]
_shared: dict[tuple[str, ...], list[Any]] = {}


def opened_backends() -> list[Backend]:
    """The backends handles share in this process now (for tests and diagnostics)."""
    with _shared_lock:
        return [entry[0] for entry in _shared.values()]


def _context(context: BackendContext | Mapping[str, Any] | None) -> BackendContext:
    if isinstance(context, BackendContext):
        return context
    return BackendContext.model_validate(dict(context or {}))


class BackendHandle:
    """One backend by name, opened when first needed (see the module docstring).

    :param name: the backend's entry-point name, or its class.
    :param config: its settings (as :func:`kvcore.open_backend` takes them).
    :param context: the engine's layout, rank, world size, namespace.
    :param requires: capabilities the caller needs, e.g. ``{"io": "host", "addressing":
        "key"}``: a backend that lacks one is closed again and refused with a
        :class:`~kvcore.errors.ConfigError` naming it.
    :param retry_s: how long :meth:`get` waits after a failed open before trying again (0:
        never again).
    :param share: share one opened backend with every handle of the same settings in this
        process.
    :param on_open: called with the backend each time this handle opens it, before anyone
        gets it (what a caller sets up once per opened backend: a buffer registration, an
        event subscription); if it raises, the open failed (and :meth:`get` tries again
        later).

    .. versionchanged:: 0.3 ``on_open``; :attr:`opened`.
    """

    def __init__(
        self,
        name: str | type,
        config: BaseModel | Mapping[str, Any] | str | None = None,
        *,
        context: BackendContext | Mapping[str, Any] | None = None,
        requires: Mapping[str, Any] | None = None,
        retry_s: float = 30.0,
        share: bool = False,
        strict: bool = False,
        verify_blocks: VerifyBlocks = "auto",
        on_open: Callable[[Backend], object] | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self.context = _context(context)
        self.requires = dict(requires or {})
        self.retry_s = retry_s
        self.share = share
        self.strict = strict
        self.verify_blocks = verify_blocks
        self._open_hooks: list[Callable[[Backend], object]] = [on_open] if on_open else []
        self._backend: Backend | None = None
        self._last_try = -float("inf")
        self._failures = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def label(self) -> str:
        return self.name if isinstance(self.name, str) else self.name.__name__

    @property
    def opened(self) -> Backend | None:
        """The backend if it is open now; never tries to open it (for shutdown, stats)."""
        return self._backend

    @property
    def open_failures(self) -> int:
        """How many times opening failed (a counter for the caller's stats)."""
        return self._failures

    def open(self) -> Backend:
        """The opened backend, opened now if it is not: raises what opening raised."""
        backend = self._backend
        if backend is not None:
            return backend
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the handle of backend {self.label!r} is closed")
            if self._backend is None:
                self._last_try = time.monotonic()
                try:
                    self._backend = self._acquire()
                except KVCoreError:
                    raise
                except Exception:
                    self._failures += 1
                    raise
            return self._backend

    def get(self) -> Backend | None:
        """The opened backend, opening it if due; None while it cannot be opened (the caller
        answers a miss). Settings errors raise: retrying cannot fix them."""
        backend = self._backend
        if backend is not None or self._closed:
            return backend
        with self._lock:
            if self._backend is not None or self._closed:
                return self._backend
            now = time.monotonic()
            if self._failures and (self.retry_s == 0 or now - self._last_try < self.retry_s):
                return None
            self._last_try = now
            try:
                self._backend = self._acquire()
            except KVCoreError:
                raise
            except Exception as exc:
                self._failures += 1
                log.error(
                    "kvcore backend %r could not be opened (rank %d of %d): %s: %s; every "
                    "call is a miss until it opens (%s)",
                    self.label,
                    self.context.rank,
                    self.context.world_size,
                    type(exc).__name__,
                    exc,
                    f"next try in {self.retry_s:.0f} s" if self.retry_s else "no retry",
                )
                return None
            if self._failures:
                log.info(
                    "kvcore backend %r opened after %d failed tries", self.label, self._failures
                )
            return self._backend

    def add_open_hook(self, hook: Callable[[Backend], object]) -> None:
        """Set up each backend this handle opens from now on, as ``on_open`` does, and the one
        it holds already, now: for code given a handle built elsewhere (an adapter that takes
        its caller's handle). What ``hook`` raises for the backend already open reaches the
        caller here.

        .. versionadded:: 0.3
        """
        with self._lock:
            self._open_hooks.append(hook)
            backend = self._backend
        if backend is not None:
            hook(backend)

    def close(self) -> None:
        """Close the backend (or give up this handle's share of it); later calls get None."""
        with self._lock:
            self._closed = True
            backend, self._backend = self._backend, None
        if backend is None:
            return
        if self.share:
            _release(backend)
        else:
            backend.close()

    def __enter__(self) -> BackendHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _sharing_key(self) -> tuple[str, ...]:
        config = self.config.model_dump() if isinstance(self.config, BaseModel) else self.config
        return (
            self.name if isinstance(self.name, str) else f"{self.name.__module__}.{self.label}",
            json.dumps(config, sort_keys=True, default=str),
            self.context.model_dump_json(),
            self.verify_blocks,
            str(self.strict),
        )

    def _acquire(self) -> Backend:
        backend = self._acquire_shared()
        if self._open_hooks:
            try:
                for hook in self._open_hooks:
                    hook(backend)
            except BaseException:
                if self.share:
                    _release(backend)
                else:
                    backend.close()
                raise
        return backend

    def _acquire_shared(self) -> Backend:
        if not self.share:
            return self._open_checked()
        key = self._sharing_key()
        with _shared_lock:
            entry = _shared.get(key)
            if entry is not None:
                entry[1] += 1
                return entry[0]
            backend = self._open_checked()
            _shared[key] = [backend, 1]
            return backend

    def _open_checked(self) -> Backend:
        backend = open_backend(
            self.name,
            self.config,
            context=self.context,
            strict=self.strict,
            verify_blocks=self.verify_blocks,
        )
        try:
            require_capabilities(backend, self.requires)
        except ConfigError:
            backend.close()
            raise
        return backend


def require_capabilities(
    backend: Backend, requires: Mapping[str, Any], purpose: str = "this caller"
) -> None:
    """Refuse ``backend`` (a :class:`~kvcore.errors.ConfigError` naming what it lacks) unless
    its capabilities have every value in ``requires`` (e.g. ``{"addressing": "key", "io":
    "host"}``): the one capability check of every caller."""
    caps = backend.capabilities
    lacking = {k: v for k, v in requires.items() if getattr(caps, k) != v}
    if lacking:
        have = ", ".join(f"{k}={getattr(caps, k)!r}" for k in lacking)
        want = ", ".join(f"{k}={v!r}" for k, v in lacking.items())
        raise ConfigError(f"backend {backend.name!r} has {have}; {purpose} needs {want}")


def _release(backend: Backend) -> None:
    with _shared_lock:
        for key, entry in list(_shared.items()):
            if entry[0] is backend:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _shared[key]
                break
    backend.close()
