"""``kvcore.evictions.sink_caller``: a backend calls every version of an eviction sink one way
(``objects, deadline, tenant``), and each gets what its signature takes."""

from __future__ import annotations

import functools
from typing import Any

from kvcore.evictions import sink_caller
from kvcore.tenants import DEFAULT_TENANT

OBJECTS = [("a", memoryview(b"1")), ("b", memoryview(b"2"))]


def test_a_sink_taking_the_tenant_gets_it_and_the_deadline() -> None:
    seen: list[tuple[Any, ...]] = []

    def sink(objects, deadline, tenant):
        seen.append((len(objects), deadline, tenant))
        return ["a"]

    assert list(sink_caller(sink)(OBJECTS, 5.0, "team-a")) == ["a"]
    assert list(sink_caller(sink)(OBJECTS, None)) == ["a"]
    assert seen == [(2, 5.0, "team-a"), (2, None, DEFAULT_TENANT)]


def test_a_keyword_only_tenant_and_keywords_catch_all_get_it_too() -> None:
    seen: list[str] = []

    def keyword_only(objects, *, tenant):
        seen.append(tenant)
        return []

    def any_keywords(objects, deadline, **extra):
        seen.append(extra["tenant"])
        return []

    sink_caller(keyword_only)(OBJECTS, 1.0, "t1")
    sink_caller(any_keywords)(OBJECTS, 1.0, "t2")
    assert seen == ["t1", "t2"]


def test_older_sinks_are_called_as_they_were_written() -> None:
    seen: list[Any] = []

    def with_deadline(objects, deadline):
        seen.append(deadline)
        return ["b"]

    def first_draft(objects):  # objects alone, returning None: it took everything
        seen.append(len(objects))

    assert list(sink_caller(with_deadline)(OBJECTS, 2.0, "team-a")) == ["b"]
    assert list(sink_caller(first_draft)(OBJECTS, 2.0, "team-a")) == ["a", "b"]
    assert seen == [2.0, 2]


def test_a_partial_is_inspected_by_what_it_still_takes() -> None:
    seen: list[tuple[int, str]] = []

    def tier_sink(tier, objects, deadline, tenant=DEFAULT_TENANT):
        seen.append((tier, tenant))
        return []

    sink_caller(functools.partial(tier_sink, 0))(OBJECTS, None, "team-b")
    assert seen == [(0, "team-b")]
