"""An opened backend: one plugin in its own plugin manager, behind a fault-isolating facade.

Every call goes to this backend alone. Whatever the backend does - raise, return garbage,
overrun its deadline - the engine gets a well-formed result and a counter moves.

This module is the facade's public methods and its door checks (what a request must be before
any backend sees it). How each hook is called - fault isolation, the deadline rule, counters,
strict mode - is :mod:`kvcore.guard`; the event stream's wiring (who publishes which change)
is :mod:`kvcore.facade_events`; block digests are :mod:`kvcore.integrity`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import pluggy

from kvcore import events as ev
from kvcore.door import check_buffers
from kvcore.facade_events import FacadeEvents
from kvcore.guard import DEADLINE_GRACE_S, BackendContractError, CallGuard, GuardedDataCalls
from kvcore.integrity import BlockDigests
from kvcore.keys import object_names
from kvcore.lookups import Lookups
from kvcore.metrics import Metrics
from kvcore.read_rate import ReadRate
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
from kvcore.tenants import CANNOT_CLEAR_TENANT, check_tenant_name

# DEADLINE_GRACE_S and BackendContractError live in kvcore.guard; callers import them from here
__all__ = ["DEADLINE_GRACE_S", "Backend", "BackendContractError", "VerifyBlocks"]

#: whether an opened backend keeps block digests (:mod:`kvcore.integrity`): ``auto`` for
#: backends that keep no checksums of their own, ``always``, or ``never``
VerifyBlocks = Literal["auto", "always", "never"]


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
        self.metrics = Metrics("kvcore_backend", {"backend": name})
        #: how every hook is called: fault isolation, deadlines, counters, strict mode
        self._guard = CallGuard(
            name, self.metrics, strict=strict, concurrent=capabilities.concurrent
        )
        self._pm = pm
        hook = pm.hook
        self._flush = hook.kvcore_flush_token_index
        self._admits = bool(hook.kvcore_admit.get_hookimpls())
        self._weight_version = context.weight_version
        layout = context.layout
        self._parts = layout.parts if layout is not None else ("k", "v")
        self._layout = layout
        #: the ``verify_blocks`` this facade was opened with
        self.verify_blocks: VerifyBlocks = verify_blocks
        #: the data hooks without digests (kvcore_query, _read, _write, _remove)
        self._plain = GuardedDataCalls(self._guard, hook)
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
        #: contains, describe, names: the hooks that answer rather than count
        self._lookups = Lookups(self._guard, hook, self._digests, self.query)
        self._event_wiring = FacadeEvents(
            context.namespace,
            self._guard,
            pm,
            self._digests,
            self.part_sizes,
            self._lookups.names,
        )
        #: what the store gains and loses (:mod:`kvcore.events`); free while nobody listens
        self.events = self._event_wiring.stream
        #: how fast this store delivers reads now, measured from every read (:meth:`read`);
        #: what :class:`kvcore.load_costs.LoadDecider` weighs a load with
        self.read_rate = ReadRate()

    @property
    def strict(self) -> bool:
        """Whether what the backend does wrong is raised (its own tests) instead of counted."""
        return self._guard.strict

    @strict.setter
    def strict(self, strict: bool) -> None:
        self._guard.strict = strict

    @property
    def verifies_blocks(self) -> bool:
        """Whether this facade keeps and checks block digests (:mod:`kvcore.integrity`);
        ``versionadded 0.3``."""
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
        tenant: str | None = None,
        caller_idle: bool = False,
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
        block, each at most :data:`kvcore.MAX_BLOCK_META_BYTES`). ``tenant``, ``caller_idle``:
        as :class:`BlockRequest` says.

        .. versionchanged:: 0.3 ``block_meta``, ``tenant``, ``caller_idle``.
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
            tenant=None if tenant is None else check_tenant_name(tenant, "tenant"),
            caller_idle=caller_idle,
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
        reported = self._event_wiring.reported_by_backend
        return self.capabilities.shared and {ev.STORED, ev.REMOVED} <= reported

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
        return self._for_tenant(request, "query", (self._digests or self._plain).query(request))

    def contains(self, request: BlockRequest) -> Presence:
        """Which blocks of ``request`` are stored, each on its own: a block missing in the
        middle does not hide the ones after it (with block digests, a block counts with its
        digest). One backend call where the backend implements ``kvcore_contains``; else one
        leading-run query per gap, each counted as a query.

        .. versionadded:: 0.3
        """
        found = self._lookups.contains(request)
        if request.tenant is not None:  # nothing built for a request that names none
            self._for_tenant(request, "query", Outcome(found.count, found.failure, found.kind))
        return found

    def describe(self, request: BlockRequest) -> list[bytes | None]:
        """What each block of ``request`` said of itself when written (``block_meta``), as the
        backend stored it: None for a block without it (absent, written without it, failing
        verification, a backend that keeps none). A failure makes every block None, counted
        and logged like any other (strict mode raises).

        .. versionadded:: 0.3
        """
        return self._lookups.describe(request)

    def names(self) -> list[str]:
        """The objects the store holds now (``kvcore_names``: this namespace's at least), a
        snapshot; empty for a backend that cannot list, or on a failure (counted and logged,
        strict mode raises). Subscribe to :attr:`events` first to miss no change after it.

        .. versionadded:: 0.3
        """
        return self._lookups.names()

    def read(self, request: BlockRequest) -> Outcome:
        """Leading blocks fully read into the request's buffers (and matching their digests,
        where kept: a corrupt block is never counted); 0 on any backend failure. Timed into
        :attr:`read_rate` (``versionchanged 0.3``)."""
        self._check_buffers(request, "read")
        rate = self.read_rate
        rate.started()
        done = 0
        try:
            got = (self._digests or self._plain).read(request)
            done = int(got)
            return self._for_tenant(request, "read", got)
        finally:
            rate.finished(done * self.block_nbytes(request) if done else 0)

    def reading_in_spans(self, request: BlockRequest) -> AbstractContextManager[None]:
        """Within: reads of ``request``'s blocks in spans (slices of it, on any thread) check
        them against digests read once, now, not once per span
        (:meth:`kvcore.integrity.BlockDigests.read_once`); nothing where none are kept. ``0.3``"""
        return nullcontext() if self._digests is None else self._digests.read_once(request)

    def block_nbytes(self, request: BlockRequest) -> int:
        """Bytes of one block of ``request``, every part (0 when nothing says); ``0.3``."""
        if request.host is not None:
            return sum(request.host.nbytes)
        return sum(self.part_sizes(request) or ())

    def write(self, request: BlockRequest, *, admit: bool = False) -> Outcome:
        """Leading blocks durably stored (with their digests, where kept); 0 on any backend
        failure.

        ``admit``: ask the store's admission policy first (:meth:`admit`, refusals counted
        there) and write only the leading blocks it admits; the answer's
        :attr:`Outcome.refused` says how many it refused (the last ones: not written, and not
        a failure). For a caller whose buffers are filled already; one that fills them only
        for the admitted blocks asks :meth:`admit` itself, then writes the admitted slice
        (:class:`kvcore.HostRunner` does either, for every engine adapter).

        .. versionchanged:: 0.3 ``admit``.
        """
        refused, asked = 0, request
        if admit:
            admitted = int(self.admit(request))
            refused = request.num_blocks - admitted
            if admitted == 0:
                return self._for_tenant(asked, "write", Outcome(0, refused=refused))
            if refused:
                host = None if request.host is None else request.host.slice(0, admitted)
                device = None if request.device is None else request.device.slice(0, admitted)
                request = request.slice(0, admitted, host=host, device=device)
        self._check_buffers(request, "write")
        if self._digests is not None:
            done = self._digests.write(request)
        else:
            done = self._plain.write(request)
        if done and self._event_wiring.publishes(ev.STORED):
            self._event_wiring.publish_blocks(ev.STORED, request, int(done))
        if refused:
            done = Outcome(int(done), done.failure, done.kind, refused=refused)
        return self._for_tenant(asked, "write", done)

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
        n = self._guard.count("admit", self._pm.hook.kvcore_admit, request, {"request": request})
        if n.failure is not None:
            return Outcome(request.num_blocks)
        if n < request.num_blocks:
            self.metrics.add("admit", blocks_refused=request.num_blocks - int(n))
        return n

    def evict_to(self, sink: Callable[..., Collection[str] | None] | None) -> bool:
        """Have the backend offer what it evicts to ``sink`` before it leaves (see
        ``kvcore_evict_to``); False for backends that cannot."""
        if not self.implements("kvcore_evict_to"):
            return False
        answer = self._guard.lifecycle("evict_to", self._pm.hook.kvcore_evict_to, sink=sink)
        return bool(answer)

    def flush_token_index(self, request: BlockRequest, resident_on_device: bool) -> Outcome:
        """Blocks whose residency record changed; 0 for backends without a token index."""
        if not self.capabilities.token_index:
            return Outcome(0)
        kwargs = {"request": request, "resident_on_device": resident_on_device}
        return self._guard.count("flush", self._flush, request, kwargs)

    def remove(self, request: BlockRequest) -> Outcome:
        """Blocks of ``request`` removed on this rank (any, not a leading run); see
        ``kvcore_remove``. 0, with a failure saying so, for backends without the hook."""
        if not self.implements("kvcore_remove"):
            return Outcome(0, f"backend {self.name!r} cannot remove blocks")
        removed = self._plain.remove(request)
        if self._digests is not None:
            self._digests.remove_digests(request)
        if removed and self._event_wiring.publishes(ev.REMOVED):
            # which of the blocks had objects is the backend's secret: every name of the
            # request is reported (for an index, removing an absent object changes nothing)
            self._event_wiring.publish_blocks(ev.REMOVED, request, request.num_blocks)
        return removed

    def clear(self, tenant: str | None = None) -> Outcome:
        """Objects removed from this backend's namespace (all ranks); see ``kvcore_clear``.
        With ``tenant``: every object that tenant stored instead, of every namespace (see
        ``kvcore_clear_tenant``).

        .. versionchanged:: 0.3 ``tenant``
        """
        if tenant is not None:
            check_tenant_name(tenant, "tenant")
            if not self.implements("kvcore_clear_tenant"):
                return Outcome(
                    0, f"backend {self.name!r} {CANNOT_CLEAR_TENANT}", FailureKind.UNSUPPORTED
                )
            hook = self._pm.hook.kvcore_clear_tenant
            return self._guard.count_removed("clear_tenant", lambda: hook(tenant=tenant))[0]
        if not self.implements("kvcore_clear"):
            return Outcome(
                0, f"backend {self.name!r} cannot clear its namespace", FailureKind.UNSUPPORTED
            )
        removed, answered = self._guard.count_removed("clear", self._pm.hook.kvcore_clear)
        if answered and self._event_wiring.publishes(ev.CLEARED):
            self.events.publish(ev.CLEARED)
        return removed

    def implements(self, hook_name: str) -> bool:
        """Whether the backend implements the hook ``hook_name`` (e.g. ``"kvcore_remove"``)."""
        caller = getattr(self._pm.hook, hook_name, None)
        return caller is not None and bool(caller.get_hookimpls())

    # -- lifecycle -------------------------------------------------------------------------

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        self._guard.lifecycle(
            "register_buffer", self._pm.hook.kvcore_register_buffer, ptr=ptr, nbytes=nbytes
        )

    def unregister_buffer(self, ptr: int) -> None:
        self._guard.lifecycle("unregister_buffer", self._pm.hook.kvcore_unregister_buffer, ptr=ptr)

    def stats(self) -> dict[str, float]:
        """kvcore's per-op counters for this backend plus the backend's own ``backend_*``.

        A backend's entry that is not a number (a nested mapping, a bool, a string) is dropped,
        counted (``invalid_results.stats``) and logged once, never raised: stats are read by
        monitoring, which must not fail because one gauge is malformed.
        """
        out = self.metrics.snapshot()
        out.update({f"read_{k}": v for k, v in self.read_rate.figures().items()})  # rate now
        own = self._guard.lifecycle("stats", self._pm.hook.kvcore_stats) or {}
        out.update(self._guard.numbers("stats", own, prefix="backend_"))
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
        out = self._guard.lifecycle(
            "raw_baseline", hook, ptr=ptr, nbytes=nbytes, object_nbytes=object_nbytes
        )
        return dict(out or {})

    def close(self) -> None:
        """Close the backend once; later calls are no-ops. Subscriptions to its events end."""
        if self._guard.closed:
            return
        self.events.close()  # the last subscription to go stops the backend's reporting
        self._guard.closed = True
        self._guard.lifecycle("close", self._pm.hook.kvcore_close)
        self._pm.unregister(self.plugin)

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.capabilities
        return f"<kvcore.Backend {self.name!r} addressing={c.addressing} io={c.io}>"

    # -- internals -------------------------------------------------------------------------

    def _for_tenant(self, request: BlockRequest, op: str, got: Outcome) -> Outcome:
        """``got``, the answer to ``request``, counted under its tenant (if it names one):
        blocks asked, answered, refused by admission, and failed calls."""
        if request.tenant is not None:
            failed = {"failures": 1} if got.failure is not None else {}
            refused = {"blocks_refused": got.refused} if getattr(got, "refused", 0) else {}
            blocks, done = request.num_blocks, int(got)
            self.metrics.tenants.add(request.tenant, op, blocks=blocks, blocks_done=done,
                                     **failed, **refused)  # fmt: skip
        return got

    def _check_buffers(self, request: BlockRequest, op: str) -> None:
        """The door check of a read or write (:func:`kvcore.door.check_buffers`)."""
        check_buffers(
            request, op, self.name, self.context, self.capabilities, self.part_sizes(request)
        )

    def part_sizes(self, request: BlockRequest) -> list[int] | None:
        """Sizes the request's parts must have: as the request declares, else the layout's
        (None when neither knows: a layout-less backend, or parts the layout does not have)."""
        if request.part_nbytes is not None:
            return list(request.part_nbytes)
        layout = self._layout
        if layout is None or not set(request.parts) <= set(layout.parts):
            return None
        return [layout.part_bytes(p) for p in request.parts]
