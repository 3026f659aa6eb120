"""Every hook in kvcore/hookspecs.py is exercised by the conformance kit.

Statically: each kit test declares the hooks it calls (``kvcore.testing.exercises``), and
together the declarations cover every ``kvcore_*`` spec. Dynamically: the kit runs against a
backend that implements every hook and records which test called which; a declaration must
be true (the test calls the hook), and every hook must be called.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from pathlib import Path

import pytest

from kvcore import hookspecs
from kvcore.testing import BackendConformance, exercised_hooks


def spec_names() -> set[str]:
    """The hooks kvcore defines: functions of the hookspecs module marked as specs."""
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    return {
        name
        for name, fn in vars(hookspecs).items()
        if name.startswith("kvcore_") and inspect.isfunction(fn) and hasattr(fn, marker)
    }


def kit_tests() -> list[str]:
    return [name for name in dir(BackendConformance) if name.startswith("test_")]


def test_hookspecs_lists_name_every_spec() -> None:
    assert set(hookspecs.REQUIRED_HOOKS) | set(hookspecs.OPTIONAL_HOOKS) == spec_names()


def test_every_hook_is_exercised_by_a_kit_test() -> None:
    missing = spec_names() - set(exercised_hooks())
    assert not missing, (
        f"no kit test exercises {sorted(missing)}: add one to a mixin in kvcore/testing/kit/"
    )


def test_every_kit_test_declares_the_hooks_it_exercises() -> None:
    undeclared = [
        name
        for name in kit_tests()
        if not hasattr(getattr(BackendConformance, name), "__kvcore_exercises__")
    ]
    assert not undeclared, f"kit tests without @exercises(...): {undeclared}"


RECORDER = '''
import ctypes
import os
import time

import kvcore
from kvcore.testing import BackendConformance, DeclaredCapacity, capacity_layout
from memory_backend import MemoryBackend

LOG = os.environ["KIT_HOOK_LOG"]


def record(hook):
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split(" ")[0]
    with open(LOG, "a") as f:
        f.write(f"{test.split('[')[0]}\\t{hook}\\n")


class Recorder(MemoryBackend):
    """The reference backend with every optional hook, noting each call."""

    capabilities = MemoryBackend.capabilities.model_copy(update={"token_index": True})

    @kvcore.hookimpl
    def kvcore_query(self, request):
        record("kvcore_query")
        return MemoryBackend.kvcore_query(self, request)

    @kvcore.hookimpl
    def kvcore_contains(self, request):
        record("kvcore_contains")
        return MemoryBackend.kvcore_contains(self, request)

    @kvcore.hookimpl
    def kvcore_describe(self, request):
        record("kvcore_describe")
        return MemoryBackend.kvcore_describe(self, request)

    @kvcore.hookimpl
    def kvcore_names(self):
        record("kvcore_names")
        return MemoryBackend.kvcore_names(self)

    @kvcore.hookimpl
    def kvcore_read(self, request):
        record("kvcore_read")
        return MemoryBackend.kvcore_read(self, request)

    @kvcore.hookimpl
    def kvcore_write(self, request):
        record("kvcore_write")
        return MemoryBackend.kvcore_write(self, request)

    @kvcore.hookimpl
    def kvcore_evict_to(self, sink):
        record("kvcore_evict_to")
        return False  # the reference store never evicts on its own

    @kvcore.hookimpl
    def kvcore_admit(self, request):
        record("kvcore_admit")
        return request.num_blocks

    @kvcore.hookimpl
    def kvcore_remove(self, request):
        record("kvcore_remove")
        return MemoryBackend.kvcore_remove(self, request)

    @kvcore.hookimpl
    def kvcore_clear(self):
        record("kvcore_clear")
        return MemoryBackend.kvcore_clear(self)

    @kvcore.hookimpl
    def kvcore_clear_tenant(self, tenant):
        record("kvcore_clear_tenant")
        return MemoryBackend.kvcore_clear_tenant(self, tenant)

    @kvcore.hookimpl
    def kvcore_flush_token_index(self, request, resident_on_device):
        record("kvcore_flush_token_index")
        return MemoryBackend.kvcore_query(self, request)

    @kvcore.hookimpl
    def kvcore_register_buffer(self, ptr, nbytes):
        record("kvcore_register_buffer")

    @kvcore.hookimpl
    def kvcore_unregister_buffer(self, ptr):
        record("kvcore_unregister_buffer")

    @kvcore.hookimpl
    def kvcore_stats(self):
        record("kvcore_stats")
        return MemoryBackend.kvcore_stats(self)

    @kvcore.hookimpl
    def kvcore_raw_baseline(self, ptr, nbytes, object_nbytes):
        record("kvcore_raw_baseline")
        scratch = ctypes.create_string_buffer(nbytes)
        t0 = time.perf_counter()
        ctypes.memmove(scratch, ptr, nbytes)
        t1 = time.perf_counter()
        ctypes.memmove(ptr, scratch, nbytes)
        t2 = time.perf_counter()
        gib = nbytes / 2**30
        return {"write_gbps": gib / max(t1 - t0, 1e-9), "read_gbps": gib / max(t2 - t1, 1e-9)}

    @kvcore.hookimpl
    def kvcore_watch(self, report):
        record("kvcore_watch")  # the reference store drops nothing on its own: no kinds

    @kvcore.hookimpl
    def kvcore_close(self):
        record("kvcore_close")


class TestRecorder(BackendConformance):
    backend = Recorder

    @pytest.fixture
    def backend_capacity(self):
        return DeclaredCapacity({"max_objects": 64}, 64 * capacity_layout().part_bytes("k"))
'''


def test_the_kit_calls_every_hook_it_declares(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    log = tmp_path / "hooks.tsv"
    monkeypatch.setenv("KIT_HOOK_LOG", str(log))
    pytester.makepyfile(test_recorder="import pytest\n" + RECORDER)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, result.stdout.str()

    called: dict[str, set[str]] = defaultdict(set)
    for line in log.read_text().splitlines():
        test, hook = line.split("\t")
        called[test].add(hook)
    skipped = {
        r.nodeid.split("::")[-1].split("[")[0] for r in result.reprec.getreports() if r.skipped
    }
    declared = {
        name: set(getattr(BackendConformance, name).__kvcore_exercises__) for name in kit_tests()
    }

    never = spec_names() - set().union(*called.values())
    assert not never, f"no kit test called {sorted(never)} on a backend implementing every hook"
    false_claims = {
        name: sorted(hooks - called[name])
        for name, hooks in declared.items()
        if name not in skipped and hooks - called[name]
    }
    assert not false_claims, f"kit tests declare hooks they never called: {false_claims}"
