"""The eviction hand-over contract (:func:`kvcore.hookspecs.kvcore_evict_to`) in one place.

A store in front of another offers what it evicts to a *sink* before the objects leave it.
The sink is called as ``sink(objects, deadline)`` and returns the names it stored; the store
evicts only those (the rest stay: nothing is lost when the receiver is down or slow). A sink
that takes ``objects`` alone and returns None (the hook's first draft) took everything:
:func:`sink_caller` lets a backend call either kind one way.

.. versionadded:: 0.3
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection

__all__ = ["EvictionSink", "Objects", "sink_caller"]

#: ``[(object name, payload), ...]``: each payload is the object's verified bytes, valid only
#: during the call
Objects = list[tuple[str, memoryview]]
#: what a backend calls: ``(objects, deadline)`` -> the names the sink stored
EvictionSink = Callable[[Objects, float | None], Collection[str]]


def sink_caller(sink: Callable[..., Collection[str] | None]) -> EvictionSink:
    """``sink`` as a backend calls it (see the module docstring).

    A sink whose signature takes a second argument (or ``deadline``) gets the deadline, a
    ``time.monotonic()`` instant by which it should return (None: no deadline); a return of
    None means every object was stored (the first draft).
    """
    takes_deadline = True
    try:
        inspect.signature(sink).bind([], None)
    except TypeError:
        takes_deadline = False
    except ValueError:  # no signature to inspect (a builtin): call it with the deadline
        pass

    def call(objects: Objects, deadline: float | None) -> Collection[str]:
        stored = sink(objects, deadline) if takes_deadline else sink(objects)
        return [name for name, _ in objects] if stored is None else stored

    return call
