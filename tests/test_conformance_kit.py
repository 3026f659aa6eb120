"""The conformance kit must FAIL broken backends, each for the right reason."""

from __future__ import annotations

import textwrap

import pytest

BROKEN = {
    # counts every stored block, not the leading run
    "non_leading_query": (
        """
        def kvcore_query(self, request):
            flags = [all(n in self._objects for n in names) for names in request.object_names]
            return sum(flags)
        """,
        ["test_gap_ends_the_run"],
    ),
    # reports success for blocks it did not read
    "optimistic_read": (
        """
        def kvcore_read(self, request):
            MemoryBackend.kvcore_read(self, request)
            return request.num_blocks
        """,
        ["test_missing_keys_query_zero_and_read_zero", "test_gap_ends_the_run"],
    ),
    # keeps only the first part of each block (drops V)
    "drops_parts": (
        """
        def kvcore_write(self, request):
            import ctypes
            for i, names in enumerate(request.object_names):
                self._objects[names[0]] = ctypes.string_at(request.host.ptrs[i][0], request.host.nbytes[0])
            return request.num_blocks
        """,
        ["test_round_trip_is_byte_exact"],
    ),
    # raises on reads: strict mode lets it through
    "raises": (
        """
        def kvcore_read(self, request):
            raise RuntimeError("disk on fire")
        """,
        ["test_round_trip_is_byte_exact"],
    ),
    # returns more blocks than were asked for
    "overcounts": (
        """
        def kvcore_query(self, request):
            return MemoryBackend.kvcore_query(self, request) + 1
        """,
        ["test_missing_keys_query_zero_and_read_zero"],
    ),
    # ignores the size of the target region (partial copy counted as success)
    "ignores_size": (
        """
        def kvcore_read(self, request):
            import ctypes
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
}


@pytest.mark.parametrize("flaw", sorted(BROKEN))
def test_kit_fails_broken_backend(pytester: pytest.Pytester, flaw: str) -> None:
    body, must_fail = BROKEN[flaw]
    method = textwrap.indent(textwrap.dedent(body).strip(), "    ")
    pytester.makepyfile(
        test_broken=f"""
import kvcore
from memory_backend import MemoryBackend
from kvcore.testing import BackendConformance


class Broken(MemoryBackend):
    @kvcore.hookimpl
{method}


class TestBroken(BackendConformance):
    backend = Broken
"""
    )
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    failed = (
        {r.nodeid.split("::")[-1].split("[")[0] for r in result.reprec.getfailures()}
        if hasattr(result, "reprec")
        else set()
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) > 0, result.stdout.str()
    for name in must_fail:
        assert name in failed, f"{name} did not fail for {flaw}: {sorted(failed)}"


def test_the_backend_authors_guide_example_passes_the_kit(pytester: pytest.Pytester) -> None:
    """The code in docs/writing-a-backend.md is what a stranger copies: it must work."""
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "writing-a-backend.md").read_text()
    example = doc.split("```python\n# my_kv/__init__.py\n", 1)[1].split("```", 1)[0]
    pytester.makepyfile(my_kv=example)
    pytester.makepyfile(
        test_doc_example="""
from my_kv import MyBackend
from kvcore.testing import BackendConformance


class TestDocExample(BackendConformance):
    backend = MyBackend
"""
    )
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0, result.stdout.str()
    assert outcomes.get("passed", 0) >= 25
