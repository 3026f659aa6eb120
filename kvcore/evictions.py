"""The eviction hand-over contract (:func:`kvcore.hookspecs.kvcore_evict_to`) in one place.

A store in front of another offers what it evicts to a *sink* before the objects leave it.
The sink is called as ``sink(objects, deadline, tenant=...)`` and returns the names it stored;
the store evicts only those (the rest stay: nothing is lost when the receiver is down or
slow). One call offers one tenant's objects (:mod:`kvcore.tenants`: whose writes stored them),
so the receiver stores them as that tenant's: its shares, figures and ``clear --tenant`` see
them as the tier above did. A sink without a ``tenant`` parameter is called without it, and a
sink that takes ``objects`` alone and returns None (the hook's first draft) took everything:
:func:`sink_caller` lets a backend call every kind one way.

.. versionadded:: 0.3
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from typing import Protocol

from kvcore.tenants import DEFAULT_TENANT

__all__ = ["EvictionSink", "Objects", "sink_caller"]

#: ``[(object name, payload), ...]``: each payload is the object's verified bytes, valid only
#: during the call
Objects = list[tuple[str, memoryview]]


class EvictionSink(Protocol):
    """What a backend calls: ``(objects, deadline, tenant)`` -> the names the sink stored."""

    def __call__(
        self, objects: Objects, deadline: float | None, tenant: str = DEFAULT_TENANT
    ) -> Collection[str]: ...


def sink_caller(sink: Callable[..., Collection[str] | None]) -> EvictionSink:
    """``sink`` as a backend calls it (see the module docstring).

    A sink whose signature takes a second argument (or ``deadline``) gets the deadline, a
    ``time.monotonic()`` instant by which it should return (None: no deadline); one that takes
    ``tenant`` (or any keyword) gets the tenant whose objects these are; a return of None means
    every object was stored (the first draft).
    """
    takes_deadline = takes_tenant = True
    try:
        signature = inspect.signature(sink)
    except ValueError:  # no signature to inspect (a builtin): call it with both
        signature = None
    if signature is not None:
        kinds = {p.kind for p in signature.parameters.values()}
        takes_tenant = "tenant" in signature.parameters or inspect.Parameter.VAR_KEYWORD in kinds
        try:
            signature.bind([], None, **({"tenant": DEFAULT_TENANT} if takes_tenant else {}))
        except TypeError:
            takes_deadline = False

    def call(
        objects: Objects, deadline: float | None, tenant: str = DEFAULT_TENANT
    ) -> Collection[str]:
        args = (objects, deadline) if takes_deadline else (objects,)
        stored = sink(*args, tenant=tenant) if takes_tenant else sink(*args)
        return [name for name, _ in objects] if stored is None else stored

    return call
