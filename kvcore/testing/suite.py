"""The backend conformance suite: subclass :class:`BackendConformance` in your plugin's tests.

::

    from kvcore.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend = "mine"                      # entry-point name (or the class itself)

        @pytest.fixture
        def backend_config(self, tmp_path):   # override what your backend needs
            return {"root": str(tmp_path)}

Tests that need an optional behaviour are marked with :func:`requires`; they are skipped,
with the reason, when the backend's ``capabilities`` declare it does not have it. Every
backend is opened in strict mode, so an exception from a hook fails the test.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, ClassVar

import pytest

from kvcore.errors import ConfigError
from kvcore.registry import load_backend_class, open_backend
from kvcore.requests import BlockRequest, HostBuffers
from kvcore.schemas import CacheDType, CacheLayout, Capabilities
from kvcore.testing.harness import Harness, blocks_equal

__all__ = ["BackendConformance", "harness_opener", "requires", "small_layout"]

_DTYPES = [d.value for d in CacheDType]


def small_layout(dtype: str = "bfloat16") -> CacheLayout:
    """A layout small enough to be fast, with an extra layer whose block count differs."""
    return CacheLayout(
        num_layers=3,
        num_extra_layers=1,
        num_heads=2,
        block_size=4,
        head_dim=16,
        dtype=dtype,
        num_blocks=40,
        extra_num_blocks=36,
    )


@contextlib.contextmanager
def harness_opener(
    target: str | type, config: dict | None = None, context: dict | None = None
) -> Iterator[Callable[..., Harness]]:
    """Open backends as harnesses, strict, and close them all when the block ends.

    The opener takes config overrides (merged over ``config``), a layout (default
    :func:`small_layout`) and context fields (merged over ``context``). For a plugin's own
    tests beside the kit: ``with harness_opener("mine", base) as open_: h = open_({...})``.
    """
    opened: list[Harness] = []

    def open_(
        overrides: dict | None = None, layout: CacheLayout | None = None, **fields: Any
    ) -> Harness:
        lay = layout or small_layout()
        backend = open_backend(
            target,
            {**(config or {}), **(overrides or {})},
            context={**(context or {}), **fields, "layout": lay},
            strict=True,
        )
        h = Harness(backend, lay)
        opened.append(h)
        return h

    try:
        yield open_
    finally:
        for h in opened:
            h.backend.close()
            h.release()


def requires(**capabilities: Any) -> Callable[[Callable], Callable]:
    """Run the test only for backends whose declared capabilities match these values."""

    def mark(fn: Callable) -> Callable:
        fn.__kvcore_requires__ = capabilities  # type: ignore[attr-defined]
        return fn

    return mark


class BackendConformance:
    """Abstract conformance tests. Set ``backend``; override the ``backend_*`` fixtures."""

    #: entry-point name of the backend under test, or its class
    backend: ClassVar[str | type | None] = None
    #: seconds allowed past a deadline before a call counts as hanging
    deadline_slack_s: ClassVar[float] = 2.0

    # -- fixtures a plugin overrides -------------------------------------------------------

    @pytest.fixture
    def backend_target(self) -> str | type:
        if self.backend is None:
            pytest.fail(f"{type(self).__name__} must set `backend` (a name or a class)")
        return self.backend

    @pytest.fixture
    def backend_config(self) -> dict[str, Any]:
        """The config the backend is opened with (e.g. a temporary root)."""
        return {}

    @pytest.fixture
    def backend_context(self) -> dict[str, Any]:
        """Extra :class:`kvcore.BackendContext` fields (rank, world_size, namespace...)."""
        return {}

    # -- fixtures the suite provides -------------------------------------------------------

    @pytest.fixture
    def capabilities(self, backend_target: str | type) -> Capabilities:
        cls = (
            load_backend_class(backend_target)
            if isinstance(backend_target, str)
            else backend_target
        )
        return cls.capabilities

    @pytest.fixture(autouse=True)
    def _capability_gate(self, request: pytest.FixtureRequest, capabilities: Capabilities) -> None:
        wanted = getattr(request.function, "__kvcore_requires__", {})
        for cap, value in wanted.items():
            if getattr(capabilities, cap) != value:
                pytest.skip(f"backend declares {cap}={getattr(capabilities, cap)!r}")

    @pytest.fixture
    def open_harness(
        self, backend_target: str | type, backend_config: dict, backend_context: dict
    ) -> Iterator[Callable[..., Harness]]:
        with harness_opener(backend_target, backend_config, backend_context) as open_:
            yield lambda layout=None, **context: open_(None, layout, **context)

    @pytest.fixture
    def harness(self, open_harness: Callable[..., Harness]) -> Harness:
        return open_harness()

    # -- round trips -----------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", _DTYPES)
    def test_round_trip_is_byte_exact(
        self, open_harness: Callable[..., Harness], capabilities: Capabilities, dtype: str
    ) -> None:
        if CacheDType(dtype).has_scales and not capabilities.scales:
            pytest.skip("backend declares scales=False")
        h = open_harness(small_layout(dtype))
        seq = h.new_sequence(5)
        assert h.write(seq) == 5
        assert h.query(seq) == 5
        done, got = h.read(seq)
        assert done == 5
        assert blocks_equal(got, h.payload(seq, 0, 5)) == []

    def test_empty_request(self, harness: Harness) -> None:
        seq = harness.new_sequence(2)
        assert harness.query(seq, 0, 0) == 0
        assert harness.write(seq, 0, 0) == 0
        assert harness.read(seq, 0, 0)[0] == 0

    def test_large_batch(self, harness: Harness) -> None:
        seq = harness.new_sequence(32)
        assert harness.write(seq) == 32
        done, got = harness.read(seq)
        assert done == 32
        assert blocks_equal(got, harness.payload(seq, 0, 32)) == []

    # -- leading-run semantics -------------------------------------------------------------

    def test_missing_keys_query_zero_and_read_zero(self, harness: Harness) -> None:
        seq = harness.new_sequence(3)
        assert harness.query(seq) == 0
        assert harness.read(seq)[0] == 0

    def test_gap_ends_the_run(self, harness: Harness) -> None:
        seq = harness.new_sequence(5)
        assert harness.write(seq, 0, 2) == 2
        assert harness.write(seq, 3, 2) in (0, 1, 2)  # may be refused without block 2
        assert harness.query(seq) == 2
        done, got = harness.read(seq)
        assert done == 2
        assert blocks_equal(got[:2], harness.payload(seq, 0, 2)) == []

    def test_run_stops_where_stored_blocks_end(self, harness: Harness) -> None:
        seq = harness.new_sequence(6)
        assert harness.write(seq, 0, 4) == 4
        assert harness.query(seq) == 4
        assert harness.read(seq)[0] == 4

    def test_start_index(self, harness: Harness) -> None:
        seq = harness.new_sequence(6)
        assert harness.write(seq, 0, 3) == 3
        assert harness.write(seq, 3, 3) == 3
        assert harness.query(seq) == 6
        assert harness.query(seq, 2) == 4
        done, got = harness.read(seq, 2, 3)
        assert done == 3
        assert blocks_equal(got, harness.payload(seq, 2, 3)) == []

    @requires(addressing="token")
    def test_trailing_partial_block_is_not_counted(self, harness: Harness) -> None:
        seq = harness.new_sequence(3, extra_tokens=harness.layout.block_size // 2)
        assert harness.write(seq) == 3
        assert harness.query(seq) == 3

    @requires(addressing="key", io="host")
    def test_block_missing_a_part_does_not_count(self, harness: Harness) -> None:
        seq = harness.new_sequence(3)
        assert harness.write(seq, 0, 2) == 2
        # store block 2's K only, by writing under a request that names just that part
        full = harness.request(seq, 2, 1)
        payload = harness.payload(seq, 2, 1)
        host = harness._buffers_holding(payload)["host"]
        k_only = BlockRequest(
            task_id=full.task_id,
            block_keys=full.block_keys,
            object_names=((full.object_names[0][0],),),
            parts=("k",),
            deadline=full.deadline,
            start_block=2,
            token_ids=full.token_ids,
            host=HostBuffers(ptrs=((host.ptrs[0][0],),), nbytes=(host.nbytes[0],)),
        )
        assert harness.backend.write(k_only) == 1
        assert harness.query(seq) == 2
        assert harness.read(seq)[0] == 2

    @requires(io="host")
    def test_size_mismatch_is_a_miss(self, harness: Harness) -> None:
        seq = harness.new_sequence(2)
        assert harness.write(seq) == 2
        full = harness.request(seq)
        buffers, _ = harness._empty_buffers(2)
        host = buffers["host"]
        shrunk = HostBuffers(ptrs=host.ptrs, nbytes=tuple(n - 8 for n in host.nbytes))
        assert harness.backend.read(replace(full, host=shrunk)) == 0

    # -- writes ----------------------------------------------------------------------------

    def test_write_is_idempotent(self, harness: Harness) -> None:
        seq = harness.new_sequence(4)
        assert harness.write(seq) == 4
        assert harness.write(seq) == 4
        assert harness.query(seq) == 4
        done, got = harness.read(seq)
        assert done == 4
        assert blocks_equal(got, harness.payload(seq, 0, 4)) == []

    def test_rewrite_never_mixes_versions(self, harness: Harness) -> None:
        seq = harness.new_sequence(3)
        assert harness.write(seq, version=0) == 3
        assert harness.write(seq, version=1) == 3
        done, got = harness.read(seq)
        assert done == 3
        old, new = harness.payload(seq, 0, 3, 0), harness.payload(seq, 0, 3, 1)
        for i in range(3):
            for j in range(len(harness.parts)):
                assert got[i][j] in (old[i][j], new[i][j]), f"block {i} part {j} is torn"

    @requires(persistent=True)
    def test_data_survives_reopen(self, open_harness: Callable[..., Harness]) -> None:
        h = open_harness()
        seq = h.new_sequence(3)
        assert h.write(seq) == 3
        h.backend.close()
        h2 = open_harness()
        assert h2.query(seq) == 3
        done, got = h2.read(seq)
        assert done == 3
        assert blocks_equal(got, h2.payload(seq, 0, 3)) == []

    # -- deadlines and concurrency ---------------------------------------------------------

    def test_expired_deadline_returns_promptly(self, harness: Harness) -> None:
        seq = harness.new_sequence(8)
        assert harness.write(seq) == 8
        for call in (harness.query, lambda s, **kw: harness.read(s, **kw)[0], harness.write):
            t0 = time.monotonic()
            done = call(seq, timeout_s=1e-6)
            assert time.monotonic() - t0 < self.deadline_slack_s
            assert 0 <= done <= 8

    def test_concurrent_callers(self, harness: Harness) -> None:
        shared = harness.new_sequence(4)
        errors: list[str] = []

        def worker(k: int) -> None:
            try:
                own = harness.new_sequence(3)
                for _ in range(3):
                    assert harness.write(own) == 3
                    assert harness.write(shared) == 4
                    done, got = harness.read(own)
                    assert done == 3 and blocks_equal(got, harness.payload(own, 0, 3)) == []
                    done, got = harness.read(shared)
                    assert done == 4 and blocks_equal(got, harness.payload(shared, 0, 4)) == []
            except BaseException as exc:
                errors.append(f"worker {k}: {exc!r}")

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a concurrent call hung"
        assert errors == []

    # -- hostile input and configuration ---------------------------------------------------

    @pytest.mark.parametrize(
        "key",
        [
            "../../../../etc/passwd",
            "/absolute/path",
            "a\x00b",
            "x" * 10_000,
            "..",
            ".",
            "名前/\n\t\\",
            "CON",
            "a/../../b",
        ],
        ids=[
            "dotdot",
            "absolute",
            "nul",
            "10k",
            "twodots",
            "dot",
            "unicode-ctrl",
            "con",
            "embedded-dotdot",
        ],
    )
    def test_hostile_keys_are_data(self, harness: Harness, key: str) -> None:
        seq = harness.new_sequence(1)
        seq.keys[0] = f"{key}{seq.keys[0][:16]}"  # unique per run, still hostile
        written = harness.write(seq)
        assert written in (0, 1)
        if written:
            done, got = harness.read(seq)
            assert done == 1
            assert blocks_equal(got, harness.payload(seq, 0, 1)) == []

    def test_unknown_config_field_is_named(
        self, backend_target: str | type, backend_config: dict
    ) -> None:
        with pytest.raises(ConfigError, match="no_such_setting"):
            open_backend(backend_target, {**backend_config, "no_such_setting": 1})

    def test_bad_config_value_is_named(
        self, backend_target: str | type, backend_config: dict
    ) -> None:
        with pytest.raises(ConfigError, match="default_timeout_s"):
            open_backend(backend_target, {**backend_config, "default_timeout_s": -1})

    # -- token index and lifecycle ---------------------------------------------------------

    def test_flush_token_index_is_safe(self, harness: Harness, capabilities: Capabilities) -> None:
        seq = harness.new_sequence(3)
        assert harness.write(seq) == 3
        for resident in (True, False):
            n = harness.backend.flush_token_index(harness.request(seq, 1), resident)
            assert 0 <= n <= 2
            if not capabilities.token_index:
                assert n == 0
        assert harness.query(seq) == 3, "a flush must not move or drop data"

    def test_stats_are_numbers(self, harness: Harness) -> None:
        seq = harness.new_sequence(1)
        harness.write(seq)
        stats = harness.backend.stats()
        assert stats["calls.write"] == 1
        assert all(isinstance(v, float | int) for v in stats.values())

    def test_close_is_idempotent(self, harness: Harness) -> None:
        harness.backend.close()
        harness.backend.close()
