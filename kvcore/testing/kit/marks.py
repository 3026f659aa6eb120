"""The kit's marks on its tests: :func:`requires` (the capabilities a test needs, checked by
the capability gate of :class:`~kvcore.testing.kit.KitFixtures`) and :func:`exercises` (the
hooks it calls, checked against :mod:`kvcore.hookspecs`), and the lists of hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kvcore.hookspecs import OPTIONAL_HOOKS, REQUIRED_HOOKS

__all__ = ["ALL_HOOKS", "DATA_HOOKS", "exercises", "requires"]


_F = TypeVar("_F", bound=Callable[..., Any])

#: Every hook a backend can implement.
ALL_HOOKS = (*REQUIRED_HOOKS, *OPTIONAL_HOOKS)
DATA_HOOKS = ("kvcore_query", "kvcore_read", "kvcore_write")


def exercises(*hooks: str) -> Callable[[_F], _F]:
    """Declare the hooks a kit test calls (checked against :mod:`kvcore.hookspecs`)."""
    unknown = sorted(set(hooks) - set(ALL_HOOKS))
    if unknown:
        raise ValueError(f"exercises(): {unknown} are not hooks; hooks are {list(ALL_HOOKS)}")

    def mark(fn: _F) -> _F:
        # a mark on the test function, read when the kit collects its tests
        fn.__kvcore_exercises__ = tuple(hooks)  # type: ignore[attr-defined]
        return fn

    return mark


def requires(**capabilities: Any) -> Callable[[_F], _F]:
    """Run the test only for backends whose declared capabilities match these values."""

    def mark(fn: _F) -> _F:
        # a mark on the test function, read by the capability gate
        fn.__kvcore_requires__ = capabilities  # type: ignore[attr-defined]
        return fn

    return mark
