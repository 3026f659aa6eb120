"""The opened-backend facade: failures become counted misses, logged once; strict re-raises."""

from __future__ import annotations

import logging
import time

import pytest
from memory_backend import MemoryBackend

import kvcore
from kvcore import hookimpl
from kvcore.backend import BackendContractError


class _Misbehaving(MemoryBackend):
    behaviour = "raise"

    @hookimpl
    def kvcore_query(self, request):
        if self.behaviour == "raise":
            raise ConnectionError("store unreachable")
        if self.behaviour == "unprintable":
            raise _Unprintable()
        if self.behaviour == "too_many":
            return request.num_blocks + 1
        if self.behaviour == "not_int":
            return "3"
        if self.behaviour == "slow":
            time.sleep(0.2)
        return MemoryBackend.kvcore_query(self, request)


class _Unprintable(Exception):
    """An SDK's exception whose message cannot be built."""

    def __str__(self) -> str:
        raise ValueError("cannot format this message")


LAYOUT = kvcore.CacheLayout(num_layers=2, num_heads=1, block_size=4, head_dim=8)


def _open(behaviour: str, strict: bool = False) -> kvcore.Backend:
    _Misbehaving.behaviour = behaviour
    return kvcore.open_backend(_Misbehaving, context={"layout": LAYOUT}, strict=strict)


def test_exception_is_a_counted_miss_logged_once(caplog):
    be = _open("raise")
    req = be.request("task-7", ["a", "b"])
    with caplog.at_level(logging.DEBUG, logger="kvcore.backend"):
        assert be.query(req) == 0
        assert be.query(req) == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "task-7" in warnings[0].getMessage() and "ConnectionError" in warnings[0].getMessage()
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 1
    stats = be.stats()
    assert stats["errors.query"] == 2 and stats["calls.query"] == 2


def test_an_exception_whose_message_cannot_be_built_is_still_a_counted_miss(caplog):
    """Its __str__ raising escaped the facade to the caller as a ValueError."""
    be = _open("unprintable")
    with caplog.at_level(logging.WARNING, logger="kvcore.backend"):
        got = be.query(be.request("task-8", ["a"]))
    assert got == 0
    assert got.failure == "_Unprintable: <message not shown: its __str__ raised ValueError>"
    assert got.kind == "backend_error"
    assert "_Unprintable" in caplog.records[0].getMessage()
    assert be.stats()["errors.query"] == 1


@pytest.mark.parametrize("behaviour", ["too_many", "not_int"])
def test_contract_violations_are_misses_or_errors_in_strict_mode(behaviour):
    be = _open(behaviour)
    req = be.request("t", ["a", "b"])
    assert be.query(req) == 0
    assert be.stats()["invalid_results.query"] == 1
    with pytest.raises(BackendContractError, match="expected an int in"):
        _open(behaviour, strict=True).query(req)


def test_strict_mode_reraises():
    with pytest.raises(ConnectionError):
        _open("raise", strict=True).query(kvcore.open_backend(MemoryBackend).request("t", ["a"]))


def test_late_answers_are_counted_as_deadline_misses():
    be = _open("slow")
    assert be.query(be.request("t", ["a"], timeout_s=0.01)) == 0
    assert be.stats()["deadline_missed.query"] == 1


def test_missing_buffers_are_the_callers_error():
    be = _open("ok")
    with pytest.raises(ValueError, match="needs `host` buffers"):
        be.read(be.request("t", ["a"]))


def test_flush_is_zero_without_a_token_index_and_close_is_final():
    be = _open("ok")
    assert be.flush_token_index(be.request("t", ["a"]), True) == 0
    be.close()
    with pytest.raises(RuntimeError, match="closed"):
        be.query(be.request("t", ["a"]))


class _OddStats(MemoryBackend):
    @hookimpl
    def kvcore_stats(self):
        return {"objects": 3, "ops": {"read": 1}, "healthy": True, "name": "x"}


def test_malformed_stats_entries_are_dropped_counted_and_logged_once(caplog):
    be = kvcore.open_backend(_OddStats, context={"layout": LAYOUT})
    with caplog.at_level(logging.WARNING, logger="kvcore.backend"):
        stats = be.stats()
        be.stats()
    assert stats["backend_objects"] == 3.0
    assert not any(k.startswith("backend_ops") or k == "backend_healthy" for k in stats)
    assert be.stats()["invalid_results.stats"] == 2 * 3  # counted by the two calls before
    assert sum("are not numbers" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(BackendContractError, match="not numbers"):
        kvcore.open_backend(_OddStats, context={"layout": LAYOUT}, strict=True).stats()


class _StopsAtDeadline(MemoryBackend):
    report = None

    @hookimpl
    def kvcore_query(self, request):
        while not request.expired():
            time.sleep(0.002)
        if self.report:
            return kvcore.Outcome(0, "abandoned the store's call", self.report)
        return 0


@pytest.mark.parametrize("report", [None, "deadline"])
def test_a_short_answer_at_the_deadline_is_a_deadline_not_a_miss(report):
    _StopsAtDeadline.report = report
    be = kvcore.open_backend(_StopsAtDeadline, context={"layout": LAYOUT})
    n = be.query(be.request("t", ["a", "b"], timeout_s=0.05))
    assert (int(n), n.kind) == (0, "deadline")
    assert be.stats().get("failures_reported.query", 0) == 0


def test_a_backend_opened_for_lookups_answers_queries_and_moves_no_data():
    """``role="lookup"`` (a scheduler's client): queries as usual; reads and writes refused,
    naming the role, and a transfer manager will not take it."""
    from kvcore.errors import ConfigError
    from kvcore.transfer import TransferManager

    data = kvcore.open_backend("memory", context={"layout": LAYOUT, "namespace": "roles"})
    looker = kvcore.open_backend(
        "memory", context={"layout": LAYOUT, "namespace": "roles", "role": "lookup"}
    )
    assert (data.context.role, looker.context.role) == ("data", "lookup")
    keys = kvcore.block_hashes(list(range(8)), 4, kvcore.KeyScope(namespace="roles"))
    assert looker.query(looker.request("q", keys)) == 0
    for call in (looker.read, looker.write):
        with pytest.raises(ValueError, match="opened for lookups"):
            call(looker.request("t", keys))
    with pytest.raises(ConfigError, match="opened for lookups"):
        TransferManager({"layout": LAYOUT, "max_model_len": 64}, None, looker)
    with pytest.raises(ConfigError, match="role"):
        kvcore.open_backend("memory", context={"layout": LAYOUT, "role": "reader"})
    looker.close()
    data.close()


class _NoContains:
    """A 0.3 backend: query, read and write only (no ``kvcore_contains``)."""

    config_model = MemoryBackend.config_model
    capabilities = MemoryBackend.capabilities

    def __init__(self, config, context):
        self._inner = MemoryBackend(config, context)

    @hookimpl
    def kvcore_query(self, request):
        return self._inner.kvcore_query(request)

    @hookimpl
    def kvcore_read(self, request):
        return self._inner.kvcore_read(request)

    @hookimpl
    def kvcore_write(self, request):
        return self._inner.kvcore_write(request)


class _BadContains(MemoryBackend):
    answer = "raise"

    @hookimpl
    def kvcore_contains(self, request):
        if self.answer == "raise":
            raise ConnectionError("store unreachable")
        return [1] * request.num_blocks  # ints, not bools


def _stored_with_gaps(backend: kvcore.Backend) -> list[str]:
    """Blocks 0, 2 and 4 of six stored (three gaps)."""
    import numpy as np

    keys = kvcore.block_hashes(list(range(24)), 4, kvcore.KeyScope(namespace="gaps"))
    part = LAYOUT.part_bytes("k")
    arrays = [np.zeros(part, np.uint8), np.zeros(part, np.uint8)]
    host = kvcore.HostBuffers(ptrs=((arrays[0].ctypes.data, arrays[1].ctypes.data),),
                              nbytes=(part, part))  # fmt: skip
    for i in (0, 2, 4):
        assert backend.write(backend.request(f"w{i}", keys[i : i + 1], start_block=i, host=host))
    return keys


@pytest.mark.parametrize("backend_class", [MemoryBackend, _NoContains])
def test_contains_is_one_call_with_the_hook_and_a_query_per_gap_without(backend_class):
    backend = kvcore.open_backend(backend_class, context={"layout": LAYOUT}, verify_blocks="never")
    keys = _stored_with_gaps(backend)
    before = backend.metrics.snapshot()
    presence = backend.contains(backend.request("c", keys))
    assert presence == kvcore.Presence((True, False, True, False, True, False))
    assert presence.count == 3
    after = backend.metrics.snapshot()
    calls = {op: after.get(f"calls.{op}", 0) - before.get(f"calls.{op}", 0)
             for op in ("contains", "query")}  # fmt: skip
    if backend_class is MemoryBackend:
        assert calls == {"contains": 1, "query": 0}
    else:  # a query from the start and from after each gap but the last (block 5)
        assert calls == {"contains": 0, "query": 3}
    backend.close()


def test_a_block_counts_in_contains_only_with_its_digest():
    backend = kvcore.open_backend(MemoryBackend, context={"layout": LAYOUT})
    assert backend.verifies_blocks
    keys = _stored_with_gaps(backend)
    backend.remove(backend.request("r", keys[:6]).slice(2, 3))  # block 2: data and digest
    found = backend.contains(backend.request("c", keys))
    assert found.found == (True, False, False, False, True, False)
    backend.close()


@pytest.mark.parametrize("answer", ["raise", "ints"])
def test_a_failing_or_malformed_contains_is_a_counted_failure(answer, caplog):
    _BadContains.answer = answer
    backend = kvcore.open_backend(_BadContains, context={"layout": LAYOUT}, verify_blocks="never")
    presence = backend.contains(backend.request("c", ["a", "b"]))
    assert presence.found == (False, False)
    assert presence.failure is not None
    kind = "errors" if answer == "raise" else "invalid_results"
    assert backend.stats()[f"{kind}.contains"] == 1
    strict = kvcore.open_backend(
        _BadContains, context={"layout": LAYOUT}, verify_blocks="never", strict=True
    )
    with pytest.raises((ConnectionError, BackendContractError)):
        strict.contains(strict.request("c", ["a", "b"]))
    strict.close()
    backend.close()


class _BadDescribe(MemoryBackend):
    answer = "raise"

    @hookimpl
    def kvcore_describe(self, request):
        if self.answer == "raise":
            raise ConnectionError("store unreachable")
        return ["text"] * request.num_blocks  # str, not bytes

    @hookimpl
    def kvcore_names(self):
        if self.answer == "raise":
            raise ConnectionError("store unreachable")
        return [b"bytes", 3]  # not names


@pytest.mark.parametrize("answer", ["raise", "strs"])
def test_a_failing_or_malformed_describe_or_listing_answers_nothing_and_counts(answer):
    """A block's metadata is None and a listing empty when the hook fails or breaks the
    contract, counted like any other failure; strict mode raises."""
    _BadDescribe.answer = answer
    backend = kvcore.open_backend(_BadDescribe, context={"layout": LAYOUT}, verify_blocks="never")
    assert backend.describe(backend.request("d", ["a", "b"])) == [None, None]
    assert backend.names() == []
    kind = "errors" if answer == "raise" else "invalid_results"
    stats = backend.stats()
    assert stats[f"{kind}.describe"] == 1 and stats[f"{kind}.names"] == 1
    strict = kvcore.open_backend(
        _BadDescribe, context={"layout": LAYOUT}, verify_blocks="never", strict=True
    )
    for call in (lambda: strict.describe(strict.request("d", ["a"])), strict.names):
        with pytest.raises((ConnectionError, BackendContractError)):
            call()
    strict.close()
    backend.close()


def test_a_clear_says_by_its_kind_why_it_removed_nothing():
    """A caller tells "cannot" from "nothing of that tenant" by the answer's kind, not its
    text: kv_tiered and the kit decide on it."""
    be = kvcore.open_backend(MemoryBackend, context={"layout": LAYOUT})
    unknown = be.clear(tenant="nobody")
    assert unknown == 0 and unknown.kind is kvcore.FailureKind.UNKNOWN_TENANT
    assert "'nobody'" in str(unknown.failure)
    be.close()
    from backend_written_for_0_1 import DictBackend

    old = kvcore.open_backend(DictBackend, context={"layout": LAYOUT})
    cannot = old.clear(tenant="a")
    assert cannot == 0 and cannot.kind is kvcore.FailureKind.UNSUPPORTED
    assert "cannot clear one tenant's objects" in str(cannot.failure)
    old.close()
