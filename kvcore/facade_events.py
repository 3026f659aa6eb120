"""The facade's side of an opened backend's event stream (``Backend.events``).

A change to the store is published once, by whoever sees it: a backend that reports a kind
itself while watched (``kvcore_watch``: its evictions, a shared store's every change) is asked
to when the stream's first subscriber arrives and told to stop when the last one leaves; the
facade publishes the rest from what its own calls did (writes, removes, clears). What a backend
reports arrives as text and is read here once; digests kvcore keeps beside blocks are filtered
out, since they are kvcore's business, not the store's content.

.. versionadded:: 0.3 (this was private to :class:`kvcore.Backend`)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pluggy

from kvcore import events as ev
from kvcore.guard import BackendContractError, CallGuard
from kvcore.integrity import BlockDigests
from kvcore.keys import ObjectName, identities
from kvcore.requests import BlockRequest
from kvcore.tenants import TENANT_NAME

__all__ = ["FacadeEvents"]


class FacadeEvents:
    """One opened backend's event stream, and who publishes which kind on it."""

    __slots__ = (
        "_digests",
        "_guard",
        "_names",
        "_part_bytes",
        "_pm",
        "reported_by_backend",
        "stream",
    )

    def __init__(
        self,
        namespace: str,
        guard: CallGuard,
        pm: pluggy.PluginManager,
        digests: BlockDigests | None,
        part_bytes: Callable[[BlockRequest], list[int] | None],
        names: Callable[[], list[str]] | None = None,
    ) -> None:
        self._guard = guard
        self._pm = pm
        self._digests = digests
        #: the part sizes of a request without host buffers (the facade's door knows them)
        self._part_bytes = part_bytes
        #: the store's listing (``Backend.names``), for subscriptions that start with it
        self._names = names
        #: what the store gains and loses (:mod:`kvcore.events`); free while nobody listens
        self.stream = ev.EventStream(namespace, self.watch, self.listing)
        #: the kinds the backend reports itself while watched (kvcore then does not)
        self.reported_by_backend: frozenset[str] = frozenset()

    def publishes(self, kind: str) -> bool:
        """Whether the facade publishes a change of ``kind`` it made: somebody listens, and the
        backend does not report that kind itself."""
        return self.stream.active and kind not in self.reported_by_backend

    def watch(self, active: bool) -> None:
        """The stream's first subscriber arrived (True) or its last one left (False)."""
        guard = self._guard
        hook = self._pm.hook.kvcore_watch
        if not hook.get_hookimpls() or (guard.closed and active):
            return
        kinds = guard.lifecycle("watch", hook, report=self.report if active else None)
        reported = frozenset(kinds or ()) if active else frozenset()
        unknown = reported - set(ev.KINDS)
        if unknown:
            msg = f"backend {guard.name!r} kvcore_watch returned unknown kinds {sorted(unknown)}"
            if guard.strict:
                raise BackendContractError(msg)
            guard.failures.warning(("watch", "kinds"), "%s; ignored", msg)
            reported -= unknown
        self.reported_by_backend = reported

    def listing(self) -> tuple[list[str], list[ObjectName | None]]:
        """The store's objects as a listing subscription announces them: each name read once,
        here, and no digest kvcore keeps beside blocks (nothing for one that cannot list)."""
        names = self._names() if self._names is not None else []
        objects = [ObjectName.parse(name) for name in names]
        if self._digests is not None and names:
            is_digest = self._digests.is_digest
            keep = [i for i, name in enumerate(names) if not is_digest(name, objects[i])]
            if len(keep) < len(names):
                names = [names[i] for i in keep]
                objects = [objects[i] for i in keep]
        return names, objects

    def report(
        self,
        kind: str,
        names: Sequence[str] = (),
        sizes: Sequence[int] | None = None,
        origin: str = ev.LOCAL,
        tenant: str | None = None,
    ) -> None:
        """What a watched backend calls (``kvcore_watch``): one change it saw."""
        bad_tenant = tenant is not None and not TENANT_NAME.fullmatch(str(tenant))
        if kind not in ev.KINDS or origin not in (ev.LOCAL, ev.PEER) or bad_tenant:
            guard = self._guard
            msg = f"backend {guard.name!r} reported kind {kind!r}, origin {origin!r}" + (
                ", a tenant that is no tenant's name" if bad_tenant else ""
            )
            if guard.strict:
                raise BackendContractError(msg)
            guard.metrics.add("watch", invalid_results=1)
            guard.failures.warning(("watch", "report"), "%s; dropped", msg)
            return
        if not self.stream.active:
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
        self.stream.publish(kind, names, sizes, origin=origin, objects=objects, tenant=tenant)

    def publish_blocks(self, kind: str, request: BlockRequest, n: int) -> None:
        """Every object of the first ``n`` blocks of ``request``, as one event."""
        sizes_per_part = (
            request.host.nbytes
            if request.host is not None
            else self._part_bytes(request) or [0] * len(request.parts)
        )
        names = [name for row in request.object_names[:n] for name in row]
        objects = identities(request.object_names, n)
        self.stream.publish(
            kind, names, list(sizes_per_part) * n, objects=objects, tenant=request.tenant
        )
