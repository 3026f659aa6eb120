"""What an opened backend answers about the store without moving a block: which blocks of a
request are stored (``kvcore_contains``), what each said of itself when written
(``kvcore_describe``), and which objects the store holds (``kvcore_names``).

These hooks answer rather than count, and a backend may implement none of them (they came in
0.3). The facade (:class:`kvcore.Backend`) asks them here, through its call guard
(:mod:`kvcore.guard`), and checks that each answer has the contract's shape before a caller sees
it; a backend without ``kvcore_contains`` is asked leading-run queries instead.

.. versionadded:: 0.3 (this was private to :class:`kvcore.Backend`)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcore.guard import CallGuard, answers_per_block
from kvcore.integrity import BlockDigests
from kvcore.requests import BlockRequest, FailureKind, Outcome, Presence

__all__ = ["Lookups"]


class Lookups:
    """One opened backend's answering hooks, each None where the backend does not implement it."""

    __slots__ = ("_contains", "_describe", "_digests", "_guard", "_names", "_query")

    def __init__(
        self,
        guard: CallGuard,
        hooks: Any,
        digests: BlockDigests | None,
        query: Callable[[BlockRequest], Outcome],
    ) -> None:
        self._guard = guard
        self._contains = hooks.kvcore_contains if hooks.kvcore_contains.get_hookimpls() else None
        self._describe = hooks.kvcore_describe if hooks.kvcore_describe.get_hookimpls() else None
        self._names = hooks.kvcore_names if hooks.kvcore_names.get_hookimpls() else None
        self._digests = digests
        #: the facade's query (digests checked where kept): the fallback of ``contains``
        self._query = query

    def contains(self, request: BlockRequest) -> Presence:
        """See :meth:`kvcore.Backend.contains`."""
        n = request.num_blocks
        if n == 0:
            return Presence(())
        if self._contains is None:
            return self._contains_by_queries(request)
        guard = self._guard
        # with digests kept, a block counts only with its digest: both are asked at once
        asked = self._digests.with_digests(request) if self._digests is not None else request
        contains = self._contains
        result, seconds, raised = guard.ask("contains", lambda: contains(request=asked), request)
        if raised is not None:
            return Presence((False,) * n, *raised)
        if not answers_per_block(result, n, lambda flag: isinstance(flag, bool)):
            guard.invalid("contains", result, f"{n} bools", request, seconds)
            return Presence((False,) * n, "invalid result", FailureKind.INVALID_RESULT)
        found = tuple(result)
        guard.metrics.observe("contains", seconds, calls=1, blocks=n, blocks_done=sum(found))
        return Presence(found)

    def _contains_by_queries(self, request: BlockRequest) -> Presence:
        """:meth:`contains` of a backend without the hook: a query from each gap on."""
        n = request.num_blocks
        found: list[bool] = []
        while len(found) < n:
            got = self._query(request.slice(len(found), n))
            found.extend([True] * int(got))
            if got.failure is not None:
                found.extend([False] * (n - len(found)))
                return Presence(tuple(found), got.failure, got.kind)
            if len(found) < n:
                found.append(False)  # the gap; the next query starts after it
        return Presence(tuple(found))

    def describe(self, request: BlockRequest) -> list[bytes | None]:
        """See :meth:`kvcore.Backend.describe`."""
        n = request.num_blocks
        if self._describe is None or n == 0:
            return [None] * n
        guard = self._guard
        hook = self._describe
        result, seconds, raised = guard.ask("describe", lambda: hook(request=request), request)
        if raised is not None:
            return [None] * n
        if not answers_per_block(result, n, lambda meta: meta is None or isinstance(meta, bytes)):
            guard.invalid("describe", result, f"{n} bytes or None", request, seconds)
            return [None] * n
        found = sum(meta is not None for meta in result)
        guard.metrics.observe("describe", seconds, calls=1, blocks=n, blocks_done=found)
        return list(result)

    def names(self) -> list[str]:
        """See :meth:`kvcore.Backend.names`."""
        if self._names is None:
            return []
        guard = self._guard
        listing = self._names
        result, seconds, raised = guard.ask("names", lambda: list(listing()), None)
        if raised is not None:
            return []
        if not all(isinstance(name, str) for name in result):
            guard.invalid("names", result[:3], "str names", None, seconds)
            return []
        guard.metrics.observe("names", seconds, calls=1, blocks_done=len(result))
        return result
