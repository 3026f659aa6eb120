"""The conformance kit must FAIL broken backends, each for the right reason, and pass correct
ones that differ from the reference only in ways the contract allows.

Each case is a subclass of the in-memory reference backend with one defect (or, for the
controls, none), run through the kit with pytester. ``SharedMemory`` keeps one store for every
instance, like a server that several engine processes use: only then can two ranks or two
namespaces collide, or one instance miss what another removed.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import pytest

PRELUDE = '''
import ctypes
import re
import threading
import time
from dataclasses import replace

import pytest

import kvcore
from kvcore import Outcome
from kvcore.testing import BackendConformance, DeclaredCapacity, capacity_layout
from memory_backend import MemoryBackend

try:
    from kv_tiered import TieredBackend
except ImportError:  # the tiered stack's case is skipped
    TieredBackend = None


class SharedMemory(MemoryBackend):
    """The reference backend with one store shared by every instance (a server's view)."""

    capabilities = MemoryBackend.capabilities.model_copy(update={"shared": True})
    _store: dict = {}
    _store_meta: dict = {}  # the blocks' metadata, shared as the objects are
    _store_lock = threading.Lock()

    def __init__(self, config, context):
        super().__init__(config, context)
        self._objects = SharedMemory._store
        self._meta = SharedMemory._store_meta
        self._lock = SharedMemory._store_lock
        self._namespace_prefix = f"{context.namespace}/"

    @kvcore.hookimpl
    def kvcore_clear(self):
        # the store is shared: only this namespace's objects, every rank's
        with self._lock:
            doomed = [n for n in self._objects if n.startswith(self._namespace_prefix)]
            for n in doomed:
                del self._objects[n]
                self._meta.pop(n, None)
        return len(doomed)


class Renamed(SharedMemory):
    """Stores objects under ``rename(name)`` instead of the names kvcore computed."""

    def rename(self, name):
        return name

    def _renamed(self, request):
        names = tuple(tuple(self.rename(n) for n in block) for block in request.object_names)
        return replace(request, object_names=names)

    @kvcore.hookimpl
    def kvcore_query(self, request):
        return SharedMemory.kvcore_query(self, self._renamed(request))

    @kvcore.hookimpl
    def kvcore_read(self, request):
        return SharedMemory.kvcore_read(self, self._renamed(request))

    @kvcore.hookimpl
    def kvcore_write(self, request):
        return SharedMemory.kvcore_write(self, self._renamed(request))

    @kvcore.hookimpl
    def kvcore_remove(self, request):
        return SharedMemory.kvcore_remove(self, self._renamed(request))
'''


@dataclass
class Case:
    """A backend class body (its base named in ``base``) and what the kit must say about it."""

    base: str
    body: str
    must_fail: list[str] = field(default_factory=list)
    #: text that must appear in the kit's report (the failure names the right cause)
    says: str = ""
    #: extra lines for the test class (fixtures)
    test_body: str = ""


CAPACITY_FIXTURE = """
@pytest.fixture
def backend_capacity(self):
    return DeclaredCapacity({"max_objects": 64}, 64 * capacity_layout().part_bytes("k"))
"""

BROKEN = {
    # counts every stored block, not the leading run
    "non_leading_query": Case(
        "MemoryBackend",
        """
        @kvcore.hookimpl
        def kvcore_query(self, request):
            flags = [all(n in self._objects for n in names) for names in request.object_names]
            return sum(flags)
        """,
        ["test_gap_ends_the_run"],
    ),
    # reports success for blocks it did not read
    "optimistic_read": Case(
        "MemoryBackend",
        """
        @kvcore.hookimpl
        def kvcore_read(self, request):
            MemoryBackend.kvcore_read(self, request)
            return request.num_blocks
        """,
        ["test_missing_keys_query_zero_and_read_zero", "test_gap_ends_the_run"],
    ),
    # keeps only the first part of each block (drops V)
    "drops_parts": Case(
        "MemoryBackend",
        """
        @kvcore.hookimpl
        def kvcore_write(self, request):
            for i, names in enumerate(request.object_names):
                self._objects[names[0]] = ctypes.string_at(request.host.ptrs[i][0], request.host.nbytes[0])
            return request.num_blocks
        """,
        ["test_round_trip_is_byte_exact"],
    ),
    # a tier stack whose lower tier lies: it claims (and "reads") every block it is asked for
    "stack_with_a_lying_lower_tier": Case(
        "TieredBackend",
        '''
        """kv_tiered's stack of the reference backend over a liar, found by name."""
        ''',
        ["test_missing_keys_query_zero_and_read_zero"],
        test_body="""
        @pytest.fixture(autouse=True)
        def _liar_installed(self, tmp_path_factory, monkeypatch):
            site = tmp_path_factory.mktemp("liar-site")
            (site / "liar_tier.py").write_text(
                "import kvcore\\n"
                "from memory_backend import MemoryBackend\\n"
                "class Liar(MemoryBackend):\\n"
                "    @kvcore.hookimpl\\n"
                "    def kvcore_query(self, request):\\n"
                "        return request.num_blocks\\n"
                "    @kvcore.hookimpl\\n"
                "    def kvcore_read(self, request):\\n"
                "        return request.num_blocks\\n"
            )
            info = site / "liar_tier-0.1.dist-info"
            info.mkdir()
            (info / "METADATA").write_text("Metadata-Version: 2.1\\nName: liar-tier\\nVersion: 0.1\\n")
            (info / "entry_points.txt").write_text("[kvcore.backends]\\nliar = liar_tier:Liar\\n")
            monkeypatch.syspath_prepend(str(site))

        @pytest.fixture
        def backend_config(self):
            return {"tiers": [{"backend": "memory"}, {"backend": "liar"}]}
        """,
    ),
    # raises on reads: strict mode lets it through
    "raises": Case(
        "MemoryBackend",
        """
        @kvcore.hookimpl
        def kvcore_read(self, request):
            raise RuntimeError("disk on fire")
        """,
        ["test_round_trip_is_byte_exact"],
    ),
    # returns more blocks than were asked for
    "overcounts": Case(
        "MemoryBackend",
        """
        @kvcore.hookimpl
        def kvcore_query(self, request):
            return MemoryBackend.kvcore_query(self, request) + 1
        """,
        ["test_missing_keys_query_zero_and_read_zero"],
    ),
    # ignores the size of the target region (partial copy counted as success)
    "ignores_size": Case(
        "MemoryBackend",
        """
        @kvcore.hookimpl
        def kvcore_read(self, request):
            host = request.host
            for i, names in enumerate(request.object_names):
                for j, name in enumerate(names):
                    data = self._objects.get(name)
                    if data is None:
                        return i
                    ctypes.memmove(host.ptrs[i][j], data, min(len(data), host.nbytes[j]))
            return request.num_blocks
        """,
        ["test_size_mismatch_is_a_miss"],
    ),
    # one store for all ranks, objects named without the rank: ranks overwrite each other
    "names_ignore_rank": Case(
        "Renamed",
        """
        def rename(self, name):
            return re.sub(r"/r[0-9]+of[0-9]+", "", name)
        """,
        ["test_ranks_and_namespaces_sharing_a_store_stay_apart"],
        says="object names must include rank and namespace",
    ),
    # one store for all models, objects named without the namespace
    "names_ignore_namespace": Case(
        "Renamed",
        """
        def rename(self, name):
            return name.split("/", 1)[1]
        """,
        ["test_ranks_and_namespaces_sharing_a_store_stay_apart"],
        says="namespace 'default-kit-peer' finds 3 blocks",
    ),
    # copies every block whatever the deadline says
    "ignores_deadlines": Case(
        "MemoryBackend",
        """
        @kvcore.hookimpl
        def kvcore_write(self, request):
            host = request.host
            for i, names in enumerate(request.object_names):
                for j, name in enumerate(names):
                    self._objects.setdefault(name, ctypes.string_at(host.ptrs[i][j], host.nbytes[j]))
            return request.num_blocks

        @kvcore.hookimpl
        def kvcore_read(self, request):
            host = request.host
            for i, names in enumerate(request.object_names):
                for j, name in enumerate(names):
                    data = self._objects.get(name)
                    if data is None:
                        return i
                    ctypes.memmove(host.ptrs[i][j], data, len(data))
            return request.num_blocks
        """,
        ["test_deadline_expiring_mid_operation"],
        says="kept working past the deadline: ",
    ),
    # a remote store's client without per-call timeouts, called once for the whole batch
    "one_call_per_batch": Case(
        "MemoryBackend",
        """
        def _client_call(self, request, hook):
            time.sleep(2e-5 * request.num_blocks)  # the client's own time for the batch
            return hook(self, replace(request, deadline=time.monotonic() + 3600))

        @kvcore.hookimpl
        def kvcore_write(self, request):
            return self._client_call(request, MemoryBackend.kvcore_write)

        @kvcore.hookimpl
        def kvcore_read(self, request):
            return self._client_call(request, MemoryBackend.kvcore_read)
        """,
        ["test_deadline_expiring_mid_operation"],
        says="kept working past the deadline: ",
    ),
    # remove says it removed blocks it kept
    "remove_lies": Case(
        "MemoryBackend",
        """
        @kvcore.hookimpl
        def kvcore_remove(self, request):
            return request.num_blocks
        """,
        [
            "test_remove_deletes_the_requested_blocks",
            "test_remove_of_middle_blocks_keeps_the_others",
        ],
        says="removed blocks are still found",
    ),
    # remove reaches only this instance's cache of names: other instances still find them
    "remove_unseen_by_other_instances": Case(
        "SharedMemory",
        """
        def __init__(self, config, context):
            super().__init__(config, context)
            self._known = set()  # names this instance wrote: answered without asking the store

        @kvcore.hookimpl
        def kvcore_write(self, request):
            done = SharedMemory.kvcore_write(self, request)
            self._known.update(n for names in request.object_names[:done] for n in names)
            return done

        @kvcore.hookimpl
        def kvcore_query(self, request):
            with self._lock:
                flags = [n in self._known or n in self._objects for names in request.object_names for n in names]
            return kvcore.leading_run(flags, len(request.parts))

        @kvcore.hookimpl
        def kvcore_remove(self, request):
            for names in request.object_names:
                self._known.difference_update(names)
            return SharedMemory.kvcore_remove(self, request)
        """,
        ["test_remove_is_per_rank_and_seen_by_every_instance"],
        says="removed through another instance sharing the store are still found",
    ),
    # clear drops only this rank's objects
    "clear_keeps_other_ranks": Case(
        "SharedMemory",
        """
        def __init__(self, config, context):
            super().__init__(config, context)
            self._suffix = f"/r{context.rank}of{context.world_size}"

        @kvcore.hookimpl
        def kvcore_clear(self):
            with self._lock:
                doomed = [n for n in self._objects if n.startswith(self._namespace_prefix) and n.endswith(self._suffix)]
                for n in doomed:
                    del self._objects[n]
            return len(doomed)
        """,
        ["test_clear_empties_the_namespace_for_every_rank_and_no_other"],
        says="the namespace held at least 12",
    ),
    # clear drops every namespace
    "clear_spills_over": Case(
        "SharedMemory",
        """
        @kvcore.hookimpl
        def kvcore_clear(self):
            with self._lock:
                n = len(self._objects)
                self._objects.clear()
            return n
        """,
        ["test_clear_empties_the_namespace_for_every_rank_and_no_other"],
        says="clear removed blocks of another namespace",
    ),
    # a full store evicts its oldest objects, those of the batch being written included,
    # and acknowledges the whole batch
    "acknowledges_beyond_capacity": Case(
        "MemoryBackend",
        """
        @kvcore.hookimpl
        def kvcore_write(self, request):
            host = request.host
            for i, names in enumerate(request.object_names):
                for j, name in enumerate(names):
                    data = ctypes.string_at(host.ptrs[i][j], host.nbytes[j])
                    with self._lock:
                        while len(self._objects) >= self.config.max_objects:
                            del self._objects[next(iter(self._objects))]  # the oldest
                        self._objects[name] = data
            return request.num_blocks
        """,
        ["test_oversize_batch_acknowledges_only_what_it_keeps"],
        says="a write must never acknowledge blocks the store did not keep",
        test_body=CAPACITY_FIXTURE,
    ),
    # stats with a nested mapping
    "nested_stats": Case(
        "MemoryBackend",
        """
        @kvcore.hookimpl
        def kvcore_stats(self):
            return {"objects": len(self._objects), "ops": {"read": 1}}
        """,
        ["test_stats_are_a_flat_mapping_of_numbers"],
    ),
    # a miss reported as a failure: every cold prefix would count as a backend error
    "absence_as_failure": Case(
        "MemoryBackend",
        """
        @kvcore.hookimpl
        def kvcore_query(self, request):
            n = MemoryBackend.kvcore_query(self, request)
            return n if n == request.num_blocks else Outcome(n, "not found")
        """,
        ["test_absence_is_not_a_failure"],
        says="absence must be a plain short count",
    ),
    # "zero-copy": keeps pointing at registered regions instead of copying out of them
    "keeps_registered_memory": Case(
        "MemoryBackend",
        """
        def __init__(self, config, context):
            super().__init__(config, context)
            self._regions = {}

        @kvcore.hookimpl
        def kvcore_register_buffer(self, ptr, nbytes):
            self._regions[ptr] = nbytes

        @kvcore.hookimpl
        def kvcore_unregister_buffer(self, ptr):
            self._regions.pop(ptr, None)

        @kvcore.hookimpl
        def kvcore_write(self, request):
            host = request.host
            for i, names in enumerate(request.object_names):
                for j, name in enumerate(names):
                    p = host.ptrs[i][j]
                    registered = any(a <= p < a + n for a, n in self._regions.items())
                    data = host.memoryview(i, j) if registered else ctypes.string_at(p, host.nbytes[j])
                    self._objects.setdefault(name, data)
            return request.num_blocks

        @kvcore.hookimpl
        def kvcore_read(self, request):
            host = request.host
            for i, names in enumerate(request.object_names):
                for j, name in enumerate(names):
                    data = self._objects.get(name)
                    if data is None or len(data) != host.nbytes[j]:
                        return i
                    host.memoryview(i, j)[:] = bytes(data)
            return request.num_blocks
        """,
        ["test_registered_regions"],
        says="stored blocks changed with the freed region",
    ),
    # takes object sizes from the layout, which tools leave out
    "needs_a_layout": Case(
        "MemoryBackend",
        """
        def __init__(self, config, context):
            super().__init__(config, context)
            self._sizes = [context.layout.part_bytes(p) for p in context.layout.parts]
        """,
        ["test_opens_without_a_layout_for_queries"],
        says="AttributeError",
    ),
    # declares segmented host buffers but only handles contiguous ones
    "claims_segmented_buffers": Case(
        "MemoryBackend",
        """
        @kvcore.hookimpl
        def kvcore_write(self, request):
            host = request.host
            for i, names in enumerate(request.object_names):
                for j, name in enumerate(names):
                    self._objects.setdefault(name, ctypes.string_at(host.ptrs[i][j], host.nbytes[j]))
            return request.num_blocks
        """,
        ["test_segmented_host_buffers_round_trip"],
    ),
}

#: Correct backends the kit must pass: they only differ from the reference in allowed ways.
CORRECT = {
    # one store for every instance, named as kvcore says
    "shared_store": Case("SharedMemory", "pass"),
    # every count returned as an Outcome, clean ones without a failure
    "outcome_results": Case(
        "MemoryBackend",
        """
        @kvcore.hookimpl
        def kvcore_query(self, request):
            return Outcome(MemoryBackend.kvcore_query(self, request))

        @kvcore.hookimpl
        def kvcore_read(self, request):
            return Outcome(MemoryBackend.kvcore_read(self, request))

        @kvcore.hookimpl
        def kvcore_write(self, request):
            n = MemoryBackend.kvcore_write(self, request)
            return n if isinstance(n, Outcome) else Outcome(n)

        @kvcore.hookimpl
        def kvcore_remove(self, request):
            return Outcome(MemoryBackend.kvcore_remove(self, request))

        @kvcore.hookimpl
        def kvcore_clear(self):
            return Outcome(MemoryBackend.kvcore_clear(self))
        """,
        test_body=CAPACITY_FIXTURE,
    ),
    # a store that cannot count what clear removed answers 0
    "clear_cannot_count": Case(
        "SharedMemory",
        """
        @kvcore.hookimpl
        def kvcore_clear(self):
            SharedMemory.kvcore_clear(self)
            return 0
        """,
    ),
}


def _run_kit(pytester: pytest.Pytester, case: Case, *, select: list[str] | None = None):
    body = textwrap.indent(textwrap.dedent(case.body).strip(), "    ")
    test_body = textwrap.indent(textwrap.dedent(case.test_body).strip(), "    ")
    pytester.makepyfile(
        test_case=f"""{PRELUDE}

class Backend({case.base}):
{body}


class TestCase(BackendConformance):
    backend = Backend
{test_body}
"""
    )
    args = ["-q", "-p", "no:cacheprovider"]
    if select:
        args += ["-k", " or ".join(select)]
    return pytester.runpytest(*args)


def _failed_tests(result: pytest.RunResult) -> set[str]:
    reports = result.reprec.getfailures() if hasattr(result, "reprec") else []
    return {r.nodeid.split("::")[-1].split("[")[0] for r in reports}


@pytest.mark.parametrize("flaw", sorted(BROKEN))
def test_kit_fails_broken_backend(pytester: pytest.Pytester, flaw: str) -> None:
    case = BROKEN[flaw]
    if case.base == "TieredBackend":
        pytest.importorskip("kv_tiered")
    result = _run_kit(pytester, case, select=case.must_fail)
    failed = _failed_tests(result)
    assert result.parseoutcomes().get("failed", 0) > 0, result.stdout.str()
    for name in case.must_fail:
        assert name in failed, f"{name} did not fail for {flaw}: {sorted(failed)}"
    if case.says:
        assert case.says in result.stdout.str(), result.stdout.str()


@pytest.mark.parametrize("variant", sorted(CORRECT))
def test_kit_passes_correct_variants(pytester: pytest.Pytester, variant: str) -> None:
    result = _run_kit(pytester, CORRECT[variant])
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, result.stdout.str()
    assert outcomes.get("passed", 0) >= 40, outcomes
