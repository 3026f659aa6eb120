"""kvcore.BackendHandle: the one way every caller opens a backend (issue 37)."""

from __future__ import annotations

import time

import pytest
from memory_backend import MemoryBackend

import kvcore
from kvcore.handles import opened_backends


class _Unreachable(MemoryBackend):
    """A backend whose server is down: opening fails, and that is not a settings error."""

    opens = 0

    def __init__(self, config, context) -> None:
        type(self).opens += 1
        raise ConnectionRefusedError("the store's server is not there")


class _Tokens(MemoryBackend):
    capabilities = kvcore.Capabilities(addressing="token", io="host")
    closed = 0

    @kvcore.hookimpl
    def kvcore_close(self) -> None:
        type(self).closed += 1


def test_settings_errors_raise_from_both_ways_of_opening() -> None:
    for call in ("open", "get"):
        with pytest.raises(kvcore.UnknownBackendError, match="nope"):
            getattr(kvcore.BackendHandle("nope"), call)()
        with pytest.raises(kvcore.ConfigError, match="no_such_setting"):
            getattr(kvcore.BackendHandle("memory", {"no_such_setting": 1}), call)()


def test_a_backend_that_cannot_open_raises_from_open_and_is_retried_by_get(monkeypatch) -> None:
    _Unreachable.opens = 0
    with pytest.raises(ConnectionRefusedError):
        kvcore.BackendHandle(_Unreachable).open()
    handle = kvcore.BackendHandle(_Unreachable, retry_s=30)
    assert handle.get() is None and handle.open_failures == 1
    assert handle.get() is None and _Unreachable.opens == 2, "retried before retry_s"
    clock = [1000.0]
    monkeypatch.setattr("kvcore.handles.time.monotonic", lambda: clock[0])
    handle._last_try = clock[0]
    clock[0] += 31
    assert handle.get() is None and _Unreachable.opens == 3, "not retried after retry_s"
    never = kvcore.BackendHandle(_Unreachable, retry_s=0)
    never.get()
    clock[0] += 1e6
    assert never.get() is None and never.open_failures == 1


def test_a_missing_capability_is_refused_by_name_and_the_backend_closed() -> None:
    handle = kvcore.BackendHandle(_Tokens, requires={"addressing": "key", "io": "host"})
    with pytest.raises(kvcore.ConfigError, match=r"addressing='token'; .* needs addressing='key'"):
        handle.open()
    assert _Tokens.closed == 1, "the refused backend was left open"


def test_shared_handles_share_one_backend_closed_with_its_last_user() -> None:
    ctx = {"namespace": "shared"}
    a = kvcore.BackendHandle("memory", context=ctx, share=True)
    b = kvcore.BackendHandle("memory", context=ctx, share=True)
    other = kvcore.BackendHandle("memory", context={"namespace": "other"}, share=True)
    private = kvcore.BackendHandle("memory", context=ctx)
    backend = a.open()
    assert b.open() is backend and other.open() is not backend
    assert private.open() is not backend, "a handle that does not share opens its own"
    assert backend in opened_backends() and private.open() not in opened_backends()
    a.close()
    assert b.open() is backend and not backend._guard.closed
    b.close()
    assert backend._guard.closed and backend not in opened_backends()
    for h in (other, private):
        h.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.open()
    assert a.get() is None


def test_on_open_runs_once_per_opened_backend_and_a_failing_one_is_a_failed_open() -> None:
    seen: list[kvcore.Backend] = []
    handle = kvcore.BackendHandle("memory", on_open=seen.append)
    assert handle.opened is None and seen == []  # opening is on first use, not construction
    backend = handle.get()
    assert backend is not None and seen == [backend] and handle.opened is backend
    assert handle.get() is backend and seen == [backend], "set up again for the same backend"
    handle.close()
    assert handle.opened is None

    _Tokens.closed = 0
    calls = []

    def refuse(backend: kvcore.Backend) -> None:
        calls.append(backend)
        if len(calls) == 1:
            raise OSError("registering the engine's memory failed")

    flaky = kvcore.BackendHandle(_Tokens, on_open=refuse, retry_s=0.01)
    assert flaky.get() is None and flaky.open_failures == 1
    assert _Tokens.closed == 1, "the backend a failed setup left behind was not closed"
    time.sleep(0.02)
    again = flaky.get()
    assert again is not None and calls[-1] is again and flaky.opened is again
    flaky.close()


def test_an_open_hook_added_later_sets_up_the_open_backend_now_and_each_one_after() -> None:
    order: list[tuple[str, kvcore.Backend]] = []
    handle = kvcore.BackendHandle(
        _Tokens, on_open=lambda b: order.append(("built", b)), retry_s=0.01
    )
    handle.add_open_hook(lambda b: order.append(("added before", b)))
    first = handle.get()
    assert first is not None
    assert order == [("built", first), ("added before", first)]
    handle.add_open_hook(lambda b: order.append(("added after", b)))
    assert order[-1] == ("added after", first), "the backend already open was not set up"
    assert handle.get() is first and len(order) == 3, "set up again for the same backend"
    handle.close()

    def refuse(backend: kvcore.Backend) -> None:
        raise kvcore.ConfigError("this store cannot hold the engine's cache")

    opened = kvcore.BackendHandle("memory")
    assert opened.get() is not None
    with pytest.raises(kvcore.ConfigError, match="cannot hold"):
        opened.add_open_hook(refuse)  # the caller learns it now, not on its first call
    opened.close()
