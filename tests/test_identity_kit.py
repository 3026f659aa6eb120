"""The key-identity kit judges adapters: a reference adapter over kv_file passes it, and one that
drops any part of a request's identity from its keys, or folds two parts in untagged, fails it
on exactly that part."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

import kvcore
from kvcore.testing.identity import (
    REQUEST_AXES,
    IdentityDriver,
    Request,
    Served,
    check_identity,
    identity_cases,
    run_identity_kit,
)

BLOCK = 16
LAYOUT = kvcore.CacheLayout(num_layers=1, num_heads=1, block_size=BLOCK, head_dim=8)


def tagged_scope(request: Request) -> kvcore.KeyScope:
    """The reference: every part of the identity in the scope, each under its own name."""
    extra = {
        "engine": request.engine,
        "cache_salt": request.cache_salt or "",
        "mm": request.mm or "",
        "prompt_embeds": request.prompt_embeds or "",
    }
    return kvcore.KeyScope(model="m", adapter=request.lora or "", extra=extra)


class FileStoreDriver(IdentityDriver):
    """An adapter that keys blocks by ``scope_of(request)`` and stores them in kv_file; a probe
    is served by a backend opened afresh, as a new engine would."""

    name = "reference"
    request_axes = frozenset(REQUEST_AXES)
    engine_variants = {"rope": "rope-2", "weight_version": "weights-v2"}
    prompt_tokens = 5 * BLOCK + 3

    def __init__(self, root: Path, scope_of: Callable[[Request], kvcore.KeyScope]) -> None:
        self.root = root
        self.scope_of = scope_of

    def _open(self) -> kvcore.Backend:
        context = kvcore.BackendContext(layout=LAYOUT, namespace="kit")
        return kvcore.open_backend("file", {"root": str(self.root)}, context=context)

    def _keys(self, request: Request) -> list[str]:
        return kvcore.block_hashes(list(request.tokens), BLOCK, self.scope_of(request))

    def serve(self, stored: Sequence[Request], probes: Sequence[Request]) -> Mapping[str, Served]:
        part = LAYOUT.part_bytes("k")
        buf = np.ones(2 * part, np.uint8)
        writer = self._open()
        for request in stored:
            keys = self._keys(request)
            host = kvcore.HostBuffers(
                ptrs=((buf.ctypes.data, buf.ctypes.data + part),) * len(keys),
                nbytes=(part, part),
            )
            assert writer.write(writer.request(request.id, keys, host=host)) == len(keys)
        writer.close()
        reader = self._open()
        out = {}
        for probe in probes:
            keys = self._keys(probe)
            found = int(reader.query(reader.request(probe.id, keys)))
            out[probe.id] = Served(found * BLOCK, len(keys) * BLOCK)
        reader.close()
        return out


def test_the_reference_adapter_passes(tmp_path: Path) -> None:
    report = check_identity(FileStoreDriver(tmp_path, tagged_scope))
    cases = identity_cases(FileStoreDriver(tmp_path, tagged_scope))
    assert report.pairs == len(cases) == 1 + 4 * 4 + 1 + 2
    assert sum(c.share for c in cases) == 5


@pytest.mark.parametrize("dropped", REQUEST_AXES)
def test_an_adapter_that_drops_a_part_fails_on_that_part(tmp_path: Path, dropped: str) -> None:
    def dropping(request: Request) -> kvcore.KeyScope:
        return tagged_scope(Request(**{**request.__dict__, dropped: None}))

    report = run_identity_kit(FileStoreDriver(tmp_path, dropping))
    assert report.failed_axes() == {dropped}, report.summary()
    assert all("must stay apart" in why for _, why in report.failures)


def test_an_adapter_that_ignores_the_engine_fails_on_every_engine_axis(tmp_path: Path) -> None:
    def engine_blind(request: Request) -> kvcore.KeyScope:
        return tagged_scope(Request(**{**request.__dict__, "engine": "base"}))

    report = run_identity_kit(FileStoreDriver(tmp_path, engine_blind))
    assert report.failed_axes() == {"rope", "weight_version"}


def test_untagged_parts_fail_where_a_name_equals_a_salt(tmp_path: Path) -> None:
    """Folding the adapter's name and the salt into one untagged value (vLLM #44701) lets a
    tenant whose salt is an adapter's name read that adapter's blocks."""

    def untagged(request: Request) -> kvcore.KeyScope:
        scope = tagged_scope(request)
        extra = {**scope.extra, "cache_salt": ""}
        return scope.model_copy(
            update={"adapter": (request.lora or "") + (request.cache_salt or ""), "extra": extra}
        )

    report = run_identity_kit(FileStoreDriver(tmp_path, untagged))
    assert [c.name.split("-", 1)[1] for c, _ in report.failures] == [
        "lora-name-vs-salt-of-that-name"
    ]


def test_a_wrong_token_fails_a_case_that_restored_nothing(tmp_path: Path) -> None:
    class LyingTokens(FileStoreDriver):
        def serve(self, stored, probes):
            out = dict(super().serve(stored, probes))
            first = probes[0].id
            out[first] = Served(
                out[first].restored_tokens, out[first].restorable_tokens, (1,), (2,)
            )
            return out

    report = run_identity_kit(LyingTokens(tmp_path, tagged_scope))
    assert len(report.failures) == 1 and "without the adapter" in report.failures[0][1]


def test_a_driver_that_restores_nothing_fails_every_shared_case(tmp_path: Path) -> None:
    class Empty(FileStoreDriver):
        def serve(self, stored, probes):
            return super().serve([], probes)

    report = run_identity_kit(Empty(tmp_path, tagged_scope))
    assert {c.name for c, _ in report.failures} == {c.name for c in report.cases if c.share}


def test_unknown_request_axes_are_refused(tmp_path: Path) -> None:
    driver = FileStoreDriver(tmp_path, tagged_scope)
    driver.request_axes = frozenset({"cache_salt", "tenant"})
    with pytest.raises(ValueError, match=r"request_axes: \['tenant'\]"):
        identity_cases(driver)
