"""An opened backend: one plugin in its own plugin manager, behind a fault-isolating facade.

Every call goes to this backend alone. Whatever the backend does - raise, return garbage,
overrun its deadline - the engine gets a well-formed result and a counter moves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import nullcontext
from typing import Any, Literal

import pluggy

from kvcore import events as ev
from kvcore.errors import describe
from kvcore.integrity import BlockDigests
from kvcore.keys import ObjectName, identities, object_names
from kvcore.metrics import Metrics, OnceLogger
from kvcore.requests import (
    BlockRequest,
    DeviceBuffers,
    FailureKind,
    HostBuffers,
    Outcome,
    Presence,
    check_block_meta,
)
from kvcore.schemas import BackendConfig, BackendContext, Capabilities, check_weight_version

__all__ = ["Backend", "BackendContractError", "VerifyBlocks"]

#: whether an opened backend keeps block digests (:mod:`kvcore.integrity`): ``auto`` for
#: backends that keep no checksums of their own, ``always``, or ``never``
VerifyBlocks = Literal["auto", "always", "never"]

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
        verify_blocks: VerifyBlocks = "auto",
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
        self._admits = bool(hook.kvcore_admit.get_hookimpls())
        self._contains = hook.kvcore_contains if hook.kvcore_contains.get_hookimpls() else None
        self._describe = hook.kvcore_describe if hook.kvcore_describe.get_hookimpls() else None
        self._names = hook.kvcore_names if hook.kvcore_names.get_hookimpls() else None
        self._serial = nullcontext() if capabilities.concurrent else threading.Lock()
        self._failures = OnceLogger(log)
        self._weight_version = context.weight_version
        self._closed = False
        layout = context.layout
        self._parts = layout.parts if layout is not None else ("k", "v")
        self._layout = layout
        #: what the store gains and loses (:mod:`kvcore.events`); free while nobody listens
        self.events = ev.EventStream(context.namespace, self._watch)
        #: the kinds the backend reports itself while watched (kvcore then does not)
        self._reported_by_backend: frozenset[str] = frozenset()
        #: the ``verify_blocks`` this facade was opened with
        self.verify_blocks: VerifyBlocks = verify_blocks
        self._plain = _PlainCalls(self)
        #: block digests beside every block (None: the backend's reads are returned as they
        #: are); digests are objects found by name, and only host memory is hashed here
        self._digests: BlockDigests | None = None
        wanted = verify_blocks == "always" or (
            verify_blocks == "auto" and not capabilities.checksums
        )
        if wanted and capabilities.io == "host" and capabilities.addressing == "key":
            self._digests = BlockDigests(
                name,
                context.namespace,
                self._plain,
                self.metrics,
                self.remove if self.implements("kvcore_remove") else None,
            )

    @property
    def verifies_blocks(self) -> bool:
        """Whether this facade keeps and checks block digests (:mod:`kvcore.integrity`).

        .. versionadded:: 0.3
        """
        return self._digests is not None

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
        num_blocks: int | None = None,
        parts: Sequence[str] | None = None,
        part_bytes: Sequence[int] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        block_meta: Sequence[bytes] | None = None,
    ) -> BlockRequest:
        """A :class:`BlockRequest` with this rank's object names.

        The deadline is ``deadline`` (a ``time.monotonic()`` instant) if given, else
        ``timeout_s`` (default: the config's ``default_timeout_s``) from now. ``num_blocks``
        defaults to ``len(block_keys)``; a request that carries tokens only (a token index's
        flush) passes ``block_keys=()`` and ``num_blocks``.

        An engine whose pages are not the layout's K and V (an MLA model's single latent part,
        a hybrid model's state pools) names its own ``parts`` and their sizes ``part_bytes``
        (checked against the host buffers at the door), and may store under another
        ``rank``/``world_size`` (MLA's latent is the same on every tensor-parallel rank, so it
        is stored once, as rank 0 of 1).

        ``block_meta``: what each block says of itself, stored with it on writes by backends
        that keep it (``Capabilities.block_meta``), for :meth:`describe` (one ``bytes`` per
        block, each at most :data:`kvcore.MAX_BLOCK_META_BYTES`).

        .. versionchanged:: 0.3 ``block_meta``.
        """
        ctx = self.context
        if deadline is None:
            timeout = self.config.default_timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + timeout
        own_parts = self._parts if parts is None else tuple(parts)
        if part_bytes is not None and len(part_bytes) != len(own_parts):
            raise ValueError(f"part_bytes has {len(part_bytes)} sizes for parts {list(own_parts)}")
        meta = None if block_meta is None else check_block_meta(block_meta, len(block_keys))
        return BlockRequest(
            task_id=task_id,
            block_keys=tuple(block_keys),
            object_names=object_names(
                block_keys,
                own_parts,
                namespace=ctx.namespace,
                rank=ctx.rank if rank is None else rank,
                world_size=ctx.world_size if world_size is None else world_size,
                weight_version=self._weight_version,
            ),
            parts=own_parts,
            deadline=deadline,
            start_block=start_block,
            token_ids=token_ids,
            host=host,
            device=device,
            num_blocks=len(block_keys) if num_blocks is None else num_blocks,
            part_nbytes=None if part_bytes is None else tuple(part_bytes),
            block_meta=meta,
        )

    @property
    def reports_whole_store(self) -> bool:
        """Whether this backend's event stream describes the whole store: while it has a
        subscriber, the backend itself reports every stored and removed object of a store it
        declares shared, whoever changed it (kv_file). Then one process following the stream
        sees what every engine sharing the store did; otherwise the stream carries this
        opener's changes (and what the backend reports besides, its evictions).
        False while nobody subscribes (the backend has not been asked to report).

        .. versionadded:: 0.3
        """
        return self.capabilities.shared and {ev.STORED, ev.REMOVED} <= self._reported_by_backend

    @property
    def weight_version(self) -> str:
        """The model-weight version in this backend's object names ("" for none)."""
        return self._weight_version

    def set_weight_version(self, version: str) -> None:
        """Scope every request built from now on to weights ``version``.

        After an engine loads new weights, KV computed with the old ones must never be served:
        with a new version, every later request names other objects, so the old blocks are
        misses (remove them with :meth:`clear` or let the store evict them). Requests built
        before the call keep the names they were built with, so a write-back of KV computed
        with the old weights cannot land under the new version.
        """
        self._weight_version = check_weight_version(version)

    # -- the data hooks --------------------------------------------------------------------
    # Each returns an Outcome: the hook's count, with ``failure`` set when the count is short
    # because something failed (not because the data is absent).

    def query(self, request: BlockRequest) -> Outcome:
        """Leading blocks present (with their digests, where kept); 0 on any backend failure."""
        if self._digests is not None:
            return self._digests.query(request)
        return self._plain.query(request)

    def contains(self, request: BlockRequest) -> Presence:
        """Which blocks of ``request`` are stored, each on its own: a block missing in the
        middle does not hide the ones after it (with block digests, a block counts with its
        digest). One backend call where the backend implements ``kvcore_contains``; else one
        leading-run query per gap, each counted as a query.

        .. versionadded:: 0.3
        """
        n = request.num_blocks
        if n == 0:
            return Presence(())
        if self._contains is None:
            return self._contains_by_queries(request)
        asked = self._digests.with_digests(request) if self._digests is not None else request
        contains = self._contains
        result, seconds, raised = self._ask("contains", lambda: contains(request=asked), request)
        if raised is not None:
            return Presence((False,) * n, *raised)
        if not _per_block(result, n, lambda flag: isinstance(flag, bool)):
            self._invalid("contains", result, f"{n} bools", request, seconds)
            return Presence((False,) * n, "invalid result", FailureKind.INVALID_RESULT)
        found = tuple(result)
        self.metrics.observe("contains", seconds, calls=1, blocks=n, blocks_done=sum(found))
        return Presence(found)

    def _contains_by_queries(self, request: BlockRequest) -> Presence:
        """:meth:`contains` of a backend without the hook: a query from each gap on."""
        n = request.num_blocks
        found: list[bool] = []
        while len(found) < n:
            got = self.query(request.slice(len(found), n))
            found.extend([True] * int(got))
            if got.failure is not None:
                found.extend([False] * (n - len(found)))
                return Presence(tuple(found), got.failure, got.kind)
            if len(found) < n:
                found.append(False)  # the gap; the next query starts after it
        return Presence(tuple(found))

    def describe(self, request: BlockRequest) -> list[bytes | None]:
        """What each block of ``request`` said of itself when written (``block_meta``), as the
        backend stored it: None for a block without it (absent, written without it, failing
        verification, a backend that keeps none). A failure makes every block None, counted
        and logged like any other (strict mode raises).

        .. versionadded:: 0.3
        """
        n = request.num_blocks
        if self._describe is None or n == 0:
            return [None] * n
        hook = self._describe
        result, seconds, raised = self._ask("describe", lambda: hook(request=request), request)
        if raised is not None:
            return [None] * n
        if not _per_block(result, n, lambda meta: meta is None or isinstance(meta, bytes)):
            self._invalid("describe", result, f"{n} bytes or None", request, seconds)
            return [None] * n
        found = sum(meta is not None for meta in result)
        self.metrics.observe("describe", seconds, calls=1, blocks=n, blocks_done=found)
        return list(result)

    def names(self) -> list[str]:
        """The objects the store holds now (``kvcore_names``: this namespace's at least), a
        snapshot; empty for a backend that cannot list, or on a failure (counted and logged,
        strict mode raises). Subscribe to :attr:`events` first to miss no change after it.

        .. versionadded:: 0.3
        """
        if self._names is None:
            return []
        listing = self._names
        result, seconds, raised = self._ask("names", lambda: list(listing()), None)
        if raised is not None:
            return []
        if not all(isinstance(name, str) for name in result):
            self._invalid("names", result[:3], "str names", None, seconds)
            return []
        self.metrics.observe("names", seconds, calls=1, blocks_done=len(result))
        return result

    def read(self, request: BlockRequest) -> Outcome:
        """Leading blocks fully read into the request's buffers (and matching their digests,
        where kept: a corrupt block is never counted); 0 on any backend failure."""
        self._check_buffers(request)
        if self._digests is not None:
            return self._digests.read(request)
        return self._plain.read(request)

    def write(self, request: BlockRequest) -> Outcome:
        """Leading blocks durably stored (with their digests, where kept); 0 on any backend
        failure."""
        self._check_buffers(request)
        if self._digests is not None:
            done = self._digests.write(request)
        else:
            done = self._plain.write(request)
        if done and self.events.active and ev.STORED not in self._reported_by_backend:
            self._publish_blocks(ev.STORED, request, int(done))
        return done

    def admit(self, request: BlockRequest) -> Outcome:
        """Leading blocks of ``request`` the backend would store if written (see
        ``kvcore_admit``); all of them for backends without the hook, or when it fails (a
        failed admission must not cost the write: the write is best-effort on its own).

        The blocks refused are counted here, for every caller, as ``blocks_refused.admit``
        (not a failure: the policy chose not to store them).

        .. versionchanged:: 0.3 refusals are counted by the facade (adapters counted them
           under names of their own)
        """
        if not self._admits:
            return Outcome(request.num_blocks)
        n = self._call("admit", self._pm.hook.kvcore_admit, request, {"request": request})
        if n.failure is not None:
            return Outcome(request.num_blocks)
        if n < request.num_blocks:
            self.metrics.add("admit", blocks_refused=request.num_blocks - int(n))
        return n

    def write_admitted(self, request: BlockRequest) -> tuple[Outcome, int]:
        """Ask the admission policy, then write the leading blocks it admits: ``(written,
        admitted)``. For a caller whose buffers are filled already; one that fills them after
        asking (so a refused block costs no copy) calls :meth:`admit`, then :meth:`write` on
        the admitted slice. Refusals are counted as in :meth:`admit`.

        .. versionadded:: 0.3
        """
        admitted = int(self.admit(request))
        if admitted == 0:
            return Outcome(0), 0
        if admitted < request.num_blocks:
            host = request.host.slice(0, admitted) if request.host is not None else None
            device = request.device.slice(0, admitted) if request.device is not None else None
            request = request.slice(0, admitted, host=host, device=device)
        return self.write(request), admitted

    def evict_to(self, sink: Callable[..., Collection[str] | None] | None) -> bool:
        """Have the backend offer what it evicts to ``sink`` before it leaves (see
        ``kvcore_evict_to``); False for backends that cannot."""
        if not self.implements("kvcore_evict_to"):
            return False
        answer = self._lifecycle("evict_to", self._pm.hook.kvcore_evict_to, sink=sink)
        return bool(answer)

    def flush_token_index(self, request: BlockRequest, resident_on_device: bool) -> Outcome:
        """Blocks whose residency record changed; 0 for backends without a token index."""
        if not self.capabilities.token_index:
            return Outcome(0)
        kwargs = {"request": request, "resident_on_device": resident_on_device}
        return self._call("flush", self._flush, request, kwargs)

    def remove(self, request: BlockRequest) -> Outcome:
        """Blocks of ``request`` removed on this rank (any, not a leading run); see
        ``kvcore_remove``. 0, with a failure saying so, for backends without the hook."""
        if not self.implements("kvcore_remove"):
            return Outcome(0, f"backend {self.name!r} cannot remove blocks")
        removed = self._plain.remove(request)
        if self._digests is not None:
            self._digests.remove_digests(request)
        if removed and self.events.active and ev.REMOVED not in self._reported_by_backend:
            # which of the blocks had objects is the backend's secret: every name of the
            # request is reported (for an index, removing an absent object changes nothing)
            self._publish_blocks(ev.REMOVED, request, request.num_blocks)
        return removed

    def clear(self) -> Outcome:
        """Objects removed from this backend's namespace (all ranks); see ``kvcore_clear``."""
        if not self.implements("kvcore_clear"):
            return Outcome(0, f"backend {self.name!r} cannot clear its namespace")
        if self._closed:
            raise RuntimeError(f"backend {self.name!r} is closed")
        t0 = time.monotonic()
        try:
            with self._serial:
                result = self._pm.hook.kvcore_clear()
        except Exception as exc:
            if self.strict:
                raise
            self._log_failure("clear", exc, None)
            self.metrics.observe("clear", time.monotonic() - t0, calls=1, errors=1)
            return Outcome(0, describe(exc))
        if result is None:
            result = 0
        if not _is_count(result) or result < 0:
            msg = f"backend {self.name!r} clear returned {result!r}; expected an int >= 0"
            if self.strict:
                raise BackendContractError(msg)
            self._log_failure("clear", BackendContractError(msg), None)
            self.metrics.observe("clear", time.monotonic() - t0, calls=1, invalid_results=1)
            return Outcome(0, "invalid result", FailureKind.INVALID_RESULT)
        self.metrics.observe("clear", time.monotonic() - t0, calls=1, objects_removed=result)
        if self.events.active and ev.CLEARED not in self._reported_by_backend:
            self.events.publish(ev.CLEARED)
        return Outcome(result, getattr(result, "failure", None))

    def implements(self, hook_name: str) -> bool:
        """Whether the backend implements the hook ``hook_name`` (e.g. ``"kvcore_remove"``)."""
        caller = getattr(self._pm.hook, hook_name, None)
        return caller is not None and bool(caller.get_hookimpls())

    # -- lifecycle -------------------------------------------------------------------------

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        self._lifecycle(
            "register_buffer", self._pm.hook.kvcore_register_buffer, ptr=ptr, nbytes=nbytes
        )

    def unregister_buffer(self, ptr: int) -> None:
        self._lifecycle("unregister_buffer", self._pm.hook.kvcore_unregister_buffer, ptr=ptr)

    def stats(self) -> dict[str, float]:
        """kvcore's per-op counters for this backend plus the backend's own ``backend_*``.

        A backend's entry that is not a number (a nested mapping, a bool, a string) is dropped,
        counted (``invalid_results.stats``) and logged once, never raised: stats are read by
        monitoring, which must not fail because one gauge is malformed.
        """
        out = self.metrics.snapshot()
        own = self._lifecycle("stats", self._pm.hook.kvcore_stats) or {}
        if not isinstance(own, Mapping):
            own = {"(not a mapping)": own}
        bad = []
        for name, value in own.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"backend_{name}"] = float(value)
            else:
                bad.append(name)
        if bad:
            msg = f"backend {self.name!r} stats: {bad} are not numbers; dropped"
            if self.strict:
                raise BackendContractError(msg)
            self.metrics.add("stats", invalid_results=len(bad))
            self._failures.warning(("stats", "invalid"), "%s", msg)
        return out

    @property
    def hook(self) -> Any:
        """The backend's hooks as pluggy calls them (``backend.hook.kvcore_read(request=...)``),
        bypassing the facade: for conformance tests that must see a hook's raw answer."""
        return self._pm.hook

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
        """Close the backend once; later calls are no-ops. Subscriptions to its events end."""
        if self._closed:
            return
        self.events.close()  # the last subscription to go stops the backend's reporting
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

    # -- events ----------------------------------------------------------------------------

    def _watch(self, active: bool) -> None:
        """The stream's first subscriber arrived (True) or its last one left (False)."""
        if not self.implements("kvcore_watch") or (self._closed and active):
            return
        kinds = self._lifecycle(
            "watch", self._pm.hook.kvcore_watch, report=self._report if active else None
        )
        reported = frozenset(kinds or ()) if active else frozenset()
        unknown = reported - set(ev.KINDS)
        if unknown:
            msg = f"backend {self.name!r} kvcore_watch returned unknown kinds {sorted(unknown)}"
            if self.strict:
                raise BackendContractError(msg)
            self._failures.warning(("watch", "kinds"), "%s; ignored", msg)
            reported -= unknown
        self._reported_by_backend = reported

    def _report(
        self,
        kind: str,
        names: Sequence[str] = (),
        sizes: Sequence[int] | None = None,
        origin: str = ev.LOCAL,
    ) -> None:
        """What a watched backend calls (``kvcore_watch``): one change it saw."""
        if kind not in ev.KINDS or origin not in (ev.LOCAL, ev.PEER):
            msg = f"backend {self.name!r} reported kind {kind!r}, origin {origin!r}"
            if self.strict:
                raise BackendContractError(msg)
            self.metrics.add("watch", invalid_results=1)
            self._failures.warning(("watch", "report"), "%s; dropped", msg)
            return
        if not self.events.active:
            return
        # a backend reports names as text (the hook contract): read once, here
        objects = [ObjectName.parse(name) for name in names]
        if self._digests is not None and names:
            # the digests kvcore keeps beside blocks are its own business, not the store's
            # content: an index of objects (a router's) never sees them
            is_digest = self._digests.is_digest
            keep = [i for i, name in enumerate(names) if not is_digest(name, objects[i])]
            if len(keep) < len(names):
                if not keep:
                    return
                names = [names[i] for i in keep]
                objects = [objects[i] for i in keep]
                sizes = None if sizes is None else [sizes[i] for i in keep]
        self.events.publish(kind, names, sizes, origin=origin, objects=objects)

    def _publish_blocks(self, kind: str, request: BlockRequest, n: int) -> None:
        """Every object of the first ``n`` blocks of ``request``, as one event."""
        sizes_per_part = (
            request.host.nbytes
            if request.host is not None
            else self._expected_part_bytes(request) or [0] * len(request.parts)
        )
        names = [name for row in request.object_names[:n] for name in row]
        objects = identities(request.object_names, n)
        self.events.publish(kind, names, list(sizes_per_part) * n, objects=objects)

    # -- internals -------------------------------------------------------------------------

    def _check_buffers(self, request: BlockRequest) -> None:
        """The door check of a read or write: what the hook spec promises a backend.

        O(1) per request (plus the part sizes): requests built by :meth:`request` and sliced
        by the core are well-formed by construction, so nothing below re-checks them.
        """
        if self.context.role == "lookup":
            raise ValueError(
                f"backend {self.name!r} was opened for lookups (context role 'lookup'): it "
                "reads and writes nothing; open it with role 'data' to move blocks"
            )
        want = self.capabilities.io
        n = request.num_blocks
        if request.block_keys and len(request.object_names) != n:
            raise ValueError(f"object_names has {len(request.object_names)} rows for {n} blocks")
        if want == "device":
            if request.device is None:
                raise ValueError(
                    f"backend {self.name!r} does device I/O: the request needs `device` buffers"
                )
            if len(request.device.block_ids) != n:
                raise ValueError(
                    f"device.block_ids has {len(request.device.block_ids)} ids for {n} blocks"
                )
            return
        host = request.host
        if host is None:
            raise ValueError(
                f"backend {self.name!r} does host I/O: the request needs `host` buffers"
            )
        if host.num_blocks != n:
            raise ValueError(f"host buffers hold {host.num_blocks} blocks; the request has {n}")
        sizes = self._expected_part_bytes(request)
        if sizes is not None and list(host.nbytes) != sizes:
            raise ValueError(
                f"host.nbytes {list(host.nbytes)} differ from the part sizes {sizes} (parts "
                f"{list(request.parts)}): a short buffer would store a truncated object"
            )
        if not host.contiguous and not self.capabilities.segmented_host:
            raise ValueError(
                f"backend {self.name!r} does not take segmented host buffers "
                "(Capabilities.segmented_host is False)"
            )

    def _expected_part_bytes(self, request: BlockRequest) -> list[int] | None:
        """Sizes the request's parts must have: as the request declares, else the layout's
        (None when neither knows: a layout-less backend, or parts the layout does not have)."""
        if request.part_nbytes is not None:
            return list(request.part_nbytes)
        layout = self._layout
        if layout is None or not set(request.parts) <= set(layout.parts):
            return None
        return [layout.part_bytes(p) for p in request.parts]

    def _call(
        self,
        op: str,
        caller: Callable[..., Any],
        request: BlockRequest,
        kwargs: dict[str, Any],
        *,
        leading: bool = True,
    ) -> Outcome:
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
            return Outcome(0, *self._raised(op, exc, request, t0))
        t1 = time.monotonic()
        if result is None and op in ("flush", "remove"):
            result = 0
        if not _is_count(result) or not 0 <= result <= n:
            self._invalid(op, result, f"an int in [0, {n}]", request, t1 - t0)
            return Outcome(0, f"invalid result {result!r}", FailureKind.INVALID_RESULT)
        failure = getattr(result, "failure", None)
        late = t1 > request.deadline + DEADLINE_GRACE_S
        counts = {"calls": 1, "blocks": n, "blocks_done": result, "deadline_missed": int(late)}
        if result >= n:  # the common answer: everything (no kind to work out)
            self.metrics.observe(op, t1 - t0, **counts)
            return Outcome(result)
        # a backend may say "deadline" itself (before it passes)
        kind = _kind_of(result)
        if t1 >= request.deadline and kind is not FailureKind.CORRUPT:
            # the one rule: short and at (or past) the deadline is a deadline, whatever the
            # backend called it (a timeout, a cancelled transfer, nothing at all)
            failure, kind = failure or "deadline missed", FailureKind.DEADLINE
        if failure is not None and kind is not FailureKind.DEADLINE:
            counts["failures_reported"] = 1
            self._failures.warning(
                (op, "reported"),
                "backend %r %s reported a failure (task %r): %s; counted as a miss (further "
                "reported failures are logged at debug level)",
                self.name,
                op,
                request.task_id,
                failure,
            )
        self.metrics.observe(op, t1 - t0, **counts)
        return Outcome(int(result), failure, kind) if failure else Outcome(result)

    def _lifecycle(self, op: str, caller: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return caller(**kwargs)
        except Exception as exc:
            if self.strict:
                raise
            self._log_failure(op, exc, None)
            self.metrics.add(op, errors=1)
            return None

    def _ask(
        self, op: str, call: Callable[[], Any], request: BlockRequest | None
    ) -> tuple[Any, float, tuple[str, FailureKind] | None]:
        """Call a hook that answers rather than counts (contains, describe, names) as every
        hook is called: refused once closed, serialised where the backend is not concurrent,
        an exception logged once and counted (strict mode raises it). Returns the answer, the
        seconds it took, and the failure and kind when it raised (else None)."""
        if self._closed:
            raise RuntimeError(f"backend {self.name!r} is closed")
        t0 = time.monotonic()
        try:
            with self._serial:
                result = call()
        except Exception as exc:
            if self.strict:
                raise
            return None, 0.0, self._raised(op, exc, request, t0)
        return result, time.monotonic() - t0, None

    def _raised(
        self, op: str, exc: Exception, request: BlockRequest | None, t0: float
    ) -> tuple[str, FailureKind]:
        """A hook call started at ``t0`` raised ``exc`` (not in strict mode): logged once,
        counted; its failure and kind (``deadline`` when it ended at or past the deadline)."""
        t1 = time.monotonic()
        n = 0 if request is None else request.num_blocks
        self._log_failure(op, exc, request)
        self.metrics.observe(op, t1 - t0, calls=1, errors=1, blocks=n)
        late = request is not None and t1 >= request.deadline and n > 0
        return describe(exc), FailureKind.DEADLINE if late else FailureKind.BACKEND_ERROR

    def _invalid(
        self,
        op: str,
        result: object,
        expected: str,
        request: BlockRequest | None,
        seconds: float,
    ) -> None:
        """A hook answered what the contract forbids: raised in strict mode, else logged once
        and counted (the caller answers with nothing found)."""
        blocks = 0 if request is None else request.num_blocks
        asked = "" if request is None else f" for {blocks} blocks"
        msg = f"backend {self.name!r} {op} returned {result!r}{asked}; expected {expected}"
        if self.strict:
            raise BackendContractError(msg)
        self._log_failure(op, BackendContractError(msg), request)
        self.metrics.observe(op, seconds, calls=1, invalid_results=1, blocks=blocks)

    def _log_failure(self, op: str, exc: BaseException, request: BlockRequest | None) -> None:
        """Log the first failure of each (op, exception type) with context; later ones at debug."""
        where = ""
        if request is not None:
            where = f" (task {request.task_id!r}, {request.num_blocks} blocks from {request.start_block})"
        kind = type(exc).__name__
        self._failures.warning(
            (op, type(exc)),
            "backend %r %s failed%s: %s; counted as a miss (further %s errors of this "
            "kind are logged at debug level)",
            self.name,
            op,
            where,
            describe(exc),
            kind,
            exc_info=exc,
        )


class _PlainCalls:
    """A facade's data calls without block digests: what :class:`BlockDigests` builds on
    (every call still fault-isolated, timed and counted; ``op`` names the counters, so the
    digests' own calls are counted apart from the data's)."""

    __slots__ = ("_backend",)

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def query(self, request: BlockRequest, op: str = "query") -> Outcome:
        b = self._backend
        return b._call(op, b._query, request, {"request": request})

    def read(self, request: BlockRequest, op: str = "read") -> Outcome:
        b = self._backend
        return b._call(op, b._read, request, {"request": request})

    def write(self, request: BlockRequest, op: str = "write") -> Outcome:
        b = self._backend
        return b._call(op, b._write, request, {"request": request})

    def remove(self, request: BlockRequest, op: str = "remove") -> Outcome:
        b = self._backend
        hook = b._pm.hook.kvcore_remove
        return b._call(op, hook, request, {"request": request}, leading=False)


def _kind_of(result: object) -> FailureKind:
    """The kind a backend gave its short count (``backend_error`` when it gave none, or one
    kvcore does not know)."""
    try:
        return FailureKind(getattr(result, "kind", None) or FailureKind.BACKEND_ERROR)
    except ValueError:
        return FailureKind.BACKEND_ERROR


def _per_block(result: object, n: int, valid: Callable[[Any], bool]) -> bool:
    """Whether ``result`` is one valid answer per block of an ``n``-block request."""
    return (
        isinstance(result, Sequence)
        and not isinstance(result, str | bytes)
        and len(result) == n
        and all(valid(item) for item in result)
    )


def _is_count(value: object) -> bool:
    """An int (an :class:`Outcome` included) and not a bool: what every count hook returns."""
    return isinstance(value, int) and not isinstance(value, bool)
