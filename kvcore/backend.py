"""An opened backend: one plugin in its own plugin manager, behind a fault-isolating facade.

Every call goes to this backend alone. Whatever the backend does - raise, return garbage,
overrun its deadline - the engine gets a well-formed result and a counter moves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import pluggy

from kvcore.keys import object_names
from kvcore.metrics import Metrics
from kvcore.requests import BlockRequest, DeviceBuffers, HostBuffers
from kvcore.schemas import BackendConfig, BackendContext, Capabilities

__all__ = ["Backend", "BackendContractError"]

log = logging.getLogger("kvcore.backend")

#: A call that returns this much after its deadline counts as a deadline miss.
DEADLINE_GRACE_S = 0.05


class BackendContractError(AssertionError):
    """A backend returned something the contract forbids (strict mode only)."""


class Backend:
    """Facade over one opened backend. Thread-safe; use :func:`kvcore.open_backend`."""

    def __init__(
        self,
        name: str,
        plugin: Any,
        pm: pluggy.PluginManager,
        config: BackendConfig,
        context: BackendContext,
        capabilities: Capabilities,
        *,
        strict: bool = False,
    ) -> None:
        self.name = name
        self.plugin = plugin
        self.config = config
        self.context = context
        self.capabilities = capabilities
        self.strict = strict
        self.metrics = Metrics("kvcore_backend", {"backend": name})
        self._pm = pm
        hook = pm.hook
        self._query = hook.kvcore_query
        self._read = hook.kvcore_read
        self._write = hook.kvcore_write
        self._flush = hook.kvcore_flush_token_index
        self._serial = nullcontext() if capabilities.concurrent else threading.Lock()
        self._logged: set[tuple[str, type]] = set()
        self._log_lock = threading.Lock()
        self._closed = False
        self._parts = context.layout.parts if context.layout is not None else ("k", "v")

    # -- building requests ---------------------------------------------------------------

    def request(
        self,
        task_id: str,
        block_keys: Sequence[str],
        *,
        start_block: int = 0,
        token_ids: Sequence[int] | None = None,
        timeout_s: float | None = None,
        deadline: float | None = None,
        host: HostBuffers | None = None,
        device: DeviceBuffers | None = None,
    ) -> BlockRequest:
        """A :class:`BlockRequest` with this rank's object names.

        The deadline is ``deadline`` (a ``time.monotonic()`` instant) if given, else
        ``timeout_s`` (default: the config's ``default_timeout_s``) from now.
        """
        ctx = self.context
        if deadline is None:
            timeout = self.config.default_timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + timeout
        return BlockRequest(
            task_id=task_id,
            block_keys=tuple(block_keys),
            object_names=object_names(
                block_keys,
                self._parts,
                namespace=ctx.namespace,
                rank=ctx.rank,
                world_size=ctx.world_size,
            ),
            parts=self._parts,
            deadline=deadline,
            start_block=start_block,
            token_ids=token_ids,
            host=host,
            device=device,
        )

    # -- the data hooks --------------------------------------------------------------------

    def query(self, request: BlockRequest) -> int:
        """Leading blocks present; 0 on any backend failure."""
        return self._call("query", self._query, request, {"request": request})

    def read(self, request: BlockRequest) -> int:
        """Leading blocks fully read into the request's buffers; 0 on any backend failure."""
        self._check_buffers(request)
        return self._call("read", self._read, request, {"request": request})

    def write(self, request: BlockRequest) -> int:
        """Leading blocks durably stored; 0 on any backend failure."""
        self._check_buffers(request)
        return self._call("write", self._write, request, {"request": request})

    def flush_token_index(self, request: BlockRequest, resident_on_device: bool) -> int:
        """Blocks whose residency record changed; 0 for backends without a token index."""
        if not self.capabilities.token_index:
            return 0
        kwargs = {"request": request, "resident_on_device": resident_on_device}
        return self._call("flush", self._flush, request, kwargs)

    # -- lifecycle -------------------------------------------------------------------------

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        self._lifecycle(
            "register_buffer", self._pm.hook.kvcore_register_buffer, ptr=ptr, nbytes=nbytes
        )

    def unregister_buffer(self, ptr: int) -> None:
        self._lifecycle("unregister_buffer", self._pm.hook.kvcore_unregister_buffer, ptr=ptr)

    def stats(self) -> dict[str, float]:
        """kvcore's per-op counters for this backend plus the backend's own ``backend_*``."""
        out = self.metrics.snapshot()
        own = self._lifecycle("stats", self._pm.hook.kvcore_stats) or {}
        if isinstance(own, Mapping):
            out.update({f"backend_{k}": float(v) for k, v in own.items()})
        return out

    def raw_baseline(self, ptr: int, nbytes: int, object_nbytes: int) -> dict[str, float]:
        """The backend's own raw-speed figures (see ``kvcore_raw_baseline``); {} if none."""
        hook = self._pm.hook.kvcore_raw_baseline
        if not hook.get_hookimpls():
            return {}
        out = self._lifecycle(
            "raw_baseline", hook, ptr=ptr, nbytes=nbytes, object_nbytes=object_nbytes
        )
        return dict(out or {})

    def close(self) -> None:
        """Close the backend once; later calls are no-ops."""
        if self._closed:
            return
        self._closed = True
        self._lifecycle("close", self._pm.hook.kvcore_close)
        self._pm.unregister(self.plugin)

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.capabilities
        return f"<kvcore.Backend {self.name!r} addressing={c.addressing} io={c.io}>"

    # -- internals -------------------------------------------------------------------------

    def _check_buffers(self, request: BlockRequest) -> None:
        want = self.capabilities.io
        given = request.host if want == "host" else request.device
        if given is None:
            raise ValueError(
                f"backend {self.name!r} does {want} I/O: the request needs `{want}` buffers"
            )

    def _call(
        self,
        op: str,
        caller: Callable[..., Any],
        request: BlockRequest,
        kwargs: dict[str, Any],
    ) -> int:
        if self._closed:
            raise RuntimeError(f"backend {self.name!r} is closed")
        n = request.num_blocks
        t0 = time.monotonic()
        try:
            with self._serial:
                result = caller(**kwargs)
        except Exception as exc:
            if self.strict:
                raise
            self._log_failure(op, exc, request)
            self.metrics.observe(op, time.monotonic() - t0, calls=1, errors=1, blocks=n)
            return 0
        t1 = time.monotonic()
        if result is None and op == "flush":
            result = 0
        if type(result) is not int or not 0 <= result <= n:
            msg = (
                f"backend {self.name!r} {op} returned {result!r} for {n} blocks; "
                f"expected an int in [0, {n}]"
            )
            if self.strict:
                raise BackendContractError(msg)
            self._log_failure(op, BackendContractError(msg), request)
            self.metrics.observe(op, t1 - t0, calls=1, invalid_results=1, blocks=n)
            return 0
        late = 1 if t1 > request.deadline + DEADLINE_GRACE_S else 0
        self.metrics.observe(
            op, t1 - t0, calls=1, blocks=n, blocks_done=result, deadline_missed=late
        )
        return result

    def _lifecycle(self, op: str, caller: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return caller(**kwargs)
        except Exception as exc:
            if self.strict:
                raise
            self._log_failure(op, exc, None)
            self.metrics.add(op, errors=1)
            return None

    def _log_failure(self, op: str, exc: BaseException, request: BlockRequest | None) -> None:
        """Log the first failure of each (op, exception type) with context; later ones at debug."""
        key = (op, type(exc))
        with self._log_lock:
            first = key not in self._logged
            self._logged.add(key)
        where = ""
        if request is not None:
            where = f" (task {request.task_id!r}, {request.num_blocks} blocks from {request.start_block})"
        if first:
            log.warning(
                "backend %r %s failed%s: %s: %s; counted as a miss (further %s errors of this "
                "kind are logged at debug level)",
                self.name,
                op,
                where,
                type(exc).__name__,
                exc,
                type(exc).__name__,
                exc_info=exc,
            )
        else:
            log.debug("backend %r %s failed%s: %r", self.name, op, where, exc)
