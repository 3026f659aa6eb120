"""The backend conformance suite: subclass :class:`BackendConformance` in your plugin's tests.

::

    from kvcore.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend = "mine"                      # entry-point name (or the class itself)

        @pytest.fixture
        def backend_config(self, tmp_path):   # override what your backend needs
            return {"root": str(tmp_path)}

Tests that need an optional behaviour are marked with :func:`requires`; they are skipped,
with the reason, when the backend's ``capabilities`` declare it does not have it. Tests of
optional hooks (``kvcore_remove``, ``kvcore_clear``, ``kvcore_raw_baseline``) run when the
backend implements them. Every backend is opened in strict mode, so an exception from a hook
fails the test. Every test declares the hooks it exercises (:func:`exercises`); kvcore's own
tests check that together they cover every hook in :mod:`kvcore.hookspecs`.
"""

from __future__ import annotations

import contextlib
import gc
import math
import numbers
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

import numpy as np
import pytest

from kvcore.backend import Backend, VerifyBlocks
from kvcore.errors import ConfigError
from kvcore.events import KINDS, StoreEvent, StoreIndex
from kvcore.handles import BackendHandle
from kvcore.hookspecs import OPTIONAL_HOOKS, REQUIRED_HOOKS
from kvcore.keys import ObjectName
from kvcore.registry import load_backend_class, open_backend
from kvcore.requests import BlockRequest, FailureKind, HostBuffers
from kvcore.schemas import CacheDType, CacheLayout, Capabilities
from kvcore.testing.harness import Harness, Sequence_, blocks_equal

__all__ = [
    "BackendConformance",
    "DeclaredCapacity",
    "capacity_layout",
    "deadline_layout",
    "exercised_hooks",
    "exercises",
    "harness_opener",
    "requires",
    "small_layout",
]

_F = TypeVar("_F", bound=Callable[..., Any])

#: Every hook a backend can implement.
ALL_HOOKS = (*REQUIRED_HOOKS, *OPTIONAL_HOOKS)
DATA_HOOKS = ("kvcore_query", "kvcore_read", "kvcore_write")

# The mid-operation deadline test grows its batch until one full call takes this long...
_DEADLINE_TARGET_S = 0.25
# ...or until it holds this many blocks of deadline_layout() (64 MiB with both parts).
_DEADLINE_MAX_BLOCKS = 32768
# The deadline given is this fraction of the backend's own time for the whole batch...
_DEADLINE_FRACTION = 1 / 8
# ...and the call may overrun it by this fraction of that time (capped by deadline_slack_s):
# a backend that honours deadlines returns near the deadline, one that ignores them near 1.0.
_DEADLINE_OVERRUN_FRACTION = 1 / 2
# Timing on a loaded machine is noisy: a backend fails only if no attempt returns in time.
_DEADLINE_ATTEMPTS = 4
# Batches larger than this would make the capacity test slow: declare a small capacity.
_CAPACITY_TEST_MAX_BYTES = 64 << 20

_DTYPES = [d.value for d in CacheDType]


def small_layout(dtype: str = "bfloat16") -> CacheLayout:
    """A layout small enough to be fast, with an extra layer whose block count differs."""
    return CacheLayout(
        num_layers=3,
        num_extra_layers=1,
        num_heads=2,
        block_size=4,
        head_dim=16,
        dtype=CacheDType(dtype),
        num_blocks=40,
        extra_num_blocks=36,
    )


def _open_without_layout(
    target: str | type, config: dict[str, Any], context: dict[str, Any]
) -> Backend:
    """The backend opened as tools open it: ``layout=None`` (strict: hook errors raise)."""
    return BackendHandle(
        target, config, context={**context, "layout": None}, strict=True, verify_blocks="never"
    ).open()


def deadline_layout(num_blocks: int = _DEADLINE_MAX_BLOCKS) -> CacheLayout:
    """Small parts (1 KiB), many blocks: the mid-operation deadline test's layout. Many small
    objects make a batch slow on any backend without needing much memory."""
    return CacheLayout(num_layers=4, num_heads=2, block_size=4, head_dim=16, num_blocks=num_blocks)


def capacity_layout(num_blocks: int = 4096) -> CacheLayout:
    """The layout of the capacity test: 16 KiB per part, 32 KiB per block."""
    return CacheLayout(num_layers=4, num_heads=4, block_size=16, head_dim=32, num_blocks=num_blocks)


@dataclass(frozen=True)
class DeclaredCapacity:
    """A capacity the conformance kit can fill: config overrides that bound the store, and
    the bound in bytes of stored objects (headers aside). Declare a small one (a few MiB):
    the kit writes batches of about twice ``nbytes``."""

    config: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 2 << 20


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


def exercised_hooks(cls: type | None = None) -> dict[str, list[str]]:
    """``{hook: [test names]}`` of the tests of ``cls`` (default: the kit) that exercise it."""
    cls = BackendConformance if cls is None else cls
    found: dict[str, list[str]] = {}
    for name in sorted(dir(cls)):
        if name.startswith("test_"):
            for hook in getattr(getattr(cls, name), "__kvcore_exercises__", ()):
                found.setdefault(hook, []).append(name)
    return found


@contextlib.contextmanager
def harness_opener(
    target: str | type,
    config: dict[str, Any] | None = None,
    context: dict[str, Any] | None = None,
    *,
    verify_blocks: VerifyBlocks = "never",
) -> Iterator[Callable[..., Harness]]:
    """Open backends as harnesses, strict, and close them all when the block ends.

    The kit checks what the backend's hooks do, so its harnesses see them without kvcore's
    block digests (``verify_blocks="never"``); what every caller gets, digests included, is
    checked by the kit's ``test_a_flipped_bit_is_never_read``.

    .. versionchanged:: 0.3 ``verify_blocks`` (opened backends keep digests themselves)

    The opener takes config overrides (merged over ``config``), a layout (default
    :func:`small_layout`) and context fields (merged over ``context``). For a plugin's own
    tests beside the kit: ``with harness_opener("mine", base) as open_: h = open_({...})``.
    """
    opened: list[Harness] = []

    def open_(
        overrides: dict[str, Any] | None = None, layout: CacheLayout | None = None, **fields: Any
    ) -> Harness:
        lay = layout or small_layout()
        backend = BackendHandle(
            target,
            {**(config or {}), **(overrides or {})},
            context={**(context or {}), **fields, "layout": lay},
            strict=True,
            verify_blocks=verify_blocks,
        ).open()
        h = Harness(backend, lay)
        opened.append(h)
        return h

    try:
        yield open_
    finally:
        for h in opened:
            h.backend.close()
            h.release()


def requires(**capabilities: Any) -> Callable[[_F], _F]:
    """Run the test only for backends whose declared capabilities match these values."""

    def mark(fn: _F) -> _F:
        # a mark on the test function, read by the capability gate
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

    @pytest.fixture
    def backend_capacity(self, backend_target: str | type) -> DeclaredCapacity | None:
        """A small capacity for the oversize-batch test; None skips that test.

        By default, a backend whose config model has a ``capacity_bytes`` field gets
        ``capacity_bytes=2 MiB``; override this fixture to declare another kind of bound.
        """
        model = _backend_class(backend_target).config_model
        if "capacity_bytes" in model.model_fields:
            return DeclaredCapacity({"capacity_bytes": 2 << 20}, 2 << 20)
        return None

    # -- fixtures the suite provides -------------------------------------------------------

    @pytest.fixture
    def capabilities(self, backend_target: str | type) -> Capabilities:
        return _backend_class(backend_target).capabilities

    @pytest.fixture(autouse=True)
    def _capability_gate(self, request: pytest.FixtureRequest, capabilities: Capabilities) -> None:
        wanted = getattr(request.function, "__kvcore_requires__", {})
        for cap, value in wanted.items():
            if getattr(capabilities, cap) != value:
                pytest.skip(f"backend declares {cap}={getattr(capabilities, cap)!r}")

    @pytest.fixture
    def open_harness(
        self,
        backend_target: str | type,
        backend_config: dict[str, Any],
        backend_context: dict[str, Any],
    ) -> Iterator[Callable[..., Harness]]:
        """``open_harness(layout=None, *, config=None, **context)``: a strict harness on the
        configured backend, with config overrides and context fields; closed at the end."""
        with harness_opener(backend_target, backend_config, backend_context) as open_:

            def open_with(
                layout: CacheLayout | None = None,
                *,
                config: dict[str, Any] | None = None,
                **context: Any,
            ) -> Harness:
                return open_(config, layout, **context)

            yield open_with

    @pytest.fixture
    def harness(self, open_harness: Callable[..., Harness]) -> Harness:
        return open_harness()

    # -- round trips -----------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", _DTYPES)
    @exercises(*DATA_HOOKS)
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

    @exercises(*DATA_HOOKS)
    def test_empty_request(self, harness: Harness) -> None:
        seq = harness.new_sequence(2)
        assert harness.query(seq, 0, 0) == 0
        assert harness.write(seq, 0, 0) == 0
        assert harness.read(seq, 0, 0)[0] == 0

    @exercises("kvcore_write", "kvcore_read")
    def test_large_batch(self, harness: Harness) -> None:
        seq = harness.new_sequence(32)
        assert harness.write(seq) == 32
        harness.assert_reads_back(seq, 32)

    # -- leading-run semantics -------------------------------------------------------------

    @exercises(*DATA_HOOKS)
    def test_object_names_as_plain_rows(self, harness: Harness) -> None:
        """``BlockRequest.object_names`` is typed as rows of names. Code other than
        ``Backend.request`` (an engine adapter, a 0.1 caller) builds it as plain tuples, and a
        backend must take those as it takes the names kvcore builds."""
        seq = harness.new_sequence(3)
        assert harness.write(seq, 0, 2) == 2
        assert harness.backend.query(_plain_rows(harness.request(seq))) == 2
        request, extract = harness.read_request(seq)
        assert harness.backend.read(_plain_rows(request)) == 2
        assert blocks_equal(extract()[:2], harness.payload(seq, 0, 2)) == []
        assert harness.backend.write(_plain_rows(harness.write_request(seq, 2, 1))) == 1
        harness.assert_reads_back(seq, 3)

    @exercises("kvcore_query", "kvcore_read")
    def test_missing_keys_query_zero_and_read_zero(self, harness: Harness) -> None:
        seq = harness.new_sequence(3)
        assert harness.query(seq) == 0
        assert harness.read(seq)[0] == 0

    @exercises(*DATA_HOOKS)
    def test_absence_is_not_a_failure(self, harness: Harness) -> None:
        """``Outcome.failure`` is for failures: a block that is simply not stored is a clean
        miss, or the engine would count every cold prefix as a backend error."""

        def plain_count(what: str, got: int, want: int) -> None:
            assert got == want, f"{what}: {int(got)} blocks, expected {want}"
            failure = getattr(got, "failure", None)
            assert failure is None, (
                f"{what} reported failure {failure!r}: absence must be a plain short count"
            )

        seq = harness.new_sequence(3)
        plain_count("query of unwritten blocks", harness.query(seq), 0)
        plain_count("read of unwritten blocks", harness.read(seq)[0], 0)
        plain_count("write of two blocks", harness.write(seq, 0, 2), 2)
        plain_count("query past the stored blocks", harness.query(seq), 2)
        plain_count("read past the stored blocks", harness.read(seq)[0], 2)

    @exercises(*DATA_HOOKS)
    def test_gap_ends_the_run(self, harness: Harness) -> None:
        seq = harness.new_sequence(5)
        assert harness.write(seq, 0, 2) == 2
        assert harness.write(seq, 3, 2) in (0, 1, 2)  # may be refused without block 2
        assert harness.query(seq) == 2
        harness.assert_reads_back(seq, 2)

    @exercises(*DATA_HOOKS)
    def test_run_stops_where_stored_blocks_end(self, harness: Harness) -> None:
        seq = harness.new_sequence(6)
        assert harness.write(seq, 0, 4) == 4
        assert harness.query(seq) == 4
        assert harness.read(seq)[0] == 4

    @exercises(*DATA_HOOKS)
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
    @exercises("kvcore_write", "kvcore_query")
    def test_trailing_partial_block_is_not_counted(self, harness: Harness) -> None:
        seq = harness.new_sequence(3, extra_tokens=harness.layout.block_size // 2)
        assert harness.write(seq) == 3
        assert harness.query(seq) == 3

    @requires(addressing="key", io="host")
    @exercises(*DATA_HOOKS)
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
    @exercises("kvcore_write", "kvcore_read")
    def test_size_mismatch_is_a_miss(
        self,
        backend_target: str | type,
        backend_config: dict[str, Any],
        backend_context: dict[str, Any],
    ) -> None:
        """A stored object whose size differs from the region asked for is a miss, never a
        partial copy. With a layout, kvcore sizes every region itself; without one (a backend
        opened for tools, or an engine that shares a store with another layout) any size
        reaches the backend, so that is where the kit asks."""
        try:
            backend = _open_without_layout(backend_target, backend_config, backend_context)
        except ConfigError as exc:
            pytest.skip(f"backend needs a layout to open: {exc}")
        harness = Harness(backend, small_layout())
        try:
            seq = harness.new_sequence(2)
            assert harness.write(seq) == 2
            request, _ = harness.read_request(seq)
            host = request.host
            assert host is not None, "a host-I/O backend's read request has host buffers"
            shrunk = HostBuffers(ptrs=host.ptrs, nbytes=tuple(n - 8 for n in host.nbytes))
            got = backend.read(replace(request, host=shrunk))
            assert got == 0, f"a read into regions 8 bytes short of the stored objects gave {got!r}"
            done, data = harness.read(seq)
            assert done == 2 and blocks_equal(data, harness.payload(seq, 0, 2)) == []
        finally:
            backend.close()
            harness.release()

    # -- writes ----------------------------------------------------------------------------

    @exercises(*DATA_HOOKS)
    def test_write_is_idempotent(self, harness: Harness) -> None:
        seq = harness.new_sequence(4)
        assert harness.write(seq) == 4
        assert harness.write(seq) == 4
        assert harness.query(seq) == 4
        harness.assert_reads_back(seq, 4)

    @exercises("kvcore_write", "kvcore_read")
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

    @exercises(*DATA_HOOKS)
    def test_oversize_batch_acknowledges_only_what_it_keeps(
        self,
        open_harness: Callable[..., Harness],
        backend_capacity: DeclaredCapacity | None,
    ) -> None:
        """A write larger than the store's capacity must not acknowledge blocks it could not
        keep (or evicted again within the same batch): a later query counts what write
        acknowledged. Then batches of a third of the capacity, one after another: each
        acknowledged run is there right after, while older batches may be evicted."""
        if backend_capacity is None:
            pytest.skip(
                "no declared capacity (config without `capacity_bytes`; override the "
                "`backend_capacity` fixture to declare one)"
            )
        cap = backend_capacity
        if 2 * cap.nbytes > _CAPACITY_TEST_MAX_BYTES:
            pytest.fail(
                f"backend_capacity declares {cap.nbytes} bytes; declare at most "
                f"{_CAPACITY_TEST_MAX_BYTES // 2} (the test writes twice the capacity)"
            )
        layout = capacity_layout()
        block = layout.block_bytes
        n = 2 * cap.nbytes // block + 1
        h = open_harness(capacity_layout(max(n, 16)), config=cap.config)
        seq = h.new_sequence(n)
        acked = _written_and_kept(
            h, seq, f"{n} blocks ({n * block} bytes, about twice the declared capacity)"
        )
        done, got = h.read(seq, 0, int(acked))
        assert done == acked, f"read restores {int(done)} of the {int(acked)} acknowledged blocks"
        assert blocks_equal(got, h.payload(seq, 0, int(acked))) == []
        third = max(1, cap.nbytes // (3 * block))
        for k in range(6):
            written_before = k * third * block + n * block
            _written_and_kept(
                h,
                h.new_sequence(third),
                f"batch {k} of {third} blocks (a third of the capacity, after {written_before} "
                "bytes already written)",
            )

    @requires(persistent=True)
    @exercises(*DATA_HOOKS, "kvcore_close")
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

    # -- ranks and namespaces --------------------------------------------------------------

    @exercises(*DATA_HOOKS)
    def test_ranks_and_namespaces_sharing_a_store_stay_apart(
        self,
        open_harness: Callable[..., Harness],
        backend_context: dict[str, Any],
        capabilities: Capabilities,
    ) -> None:
        """Two tensor-parallel ranks hold different slices of the same blocks, and two
        namespaces (models) may hold the same token path: on one store, neither may see,
        overwrite or skip the other's objects."""
        world, rank, other_rank, namespace = _rank_layout(backend_context)
        own = open_harness(rank=rank, world_size=world)
        twin = open_harness(rank=rank, world_size=world)  # another process, same context
        other_ns = f"{namespace}-kit-peer"
        peers = {
            f"rank {other_rank} of {world}": open_harness(rank=other_rank, world_size=world),
            f"namespace {other_ns!r}": open_harness(
                rank=rank, world_size=world, namespace=other_ns
            ),
        }
        seq = own.new_sequence(3)
        assert own.write(seq, version=0) == 3
        shared = _sees(twin, seq, 3)
        if capabilities.shared:
            assert shared, (
                "the backend declares shared=True, but a second instance opened with the same "
                "config and context does not see the blocks the first one wrote"
            )
        where = f"rank {rank} of {world} in namespace {namespace!r}"
        for version, (label, peer) in enumerate(peers.items(), start=1):
            seen = peer.query(seq)
            assert seen == 0, (
                f"{label} finds {int(seen)} blocks that only {where} wrote: object names must "
                "include rank and namespace (else ranks overwrite each other's slices)"
            )
            assert peer.read(seq)[0] == 0, f"{label} reads blocks that only {where} wrote"
            assert peer.write(seq, version=version) == 3
            done, got = peer.read(seq)
            assert done == 3
            assert blocks_equal(got, peer.payload(seq, 0, 3, version)) == [], (
                f"{label} reads back other bytes than it wrote (another rank's or namespace's?)"
            )
        done, got = own.read(seq)
        assert done == 3
        assert blocks_equal(got, own.payload(seq, 0, 3, 0)) == [], (
            f"{where} reads back bytes another rank or namespace wrote under the same blocks"
        )
        if shared:
            done, got = twin.read(seq)
            assert done == 3 and blocks_equal(got, own.payload(seq, 0, 3, 0)) == []

    # -- deadlines and concurrency ---------------------------------------------------------

    @exercises(*DATA_HOOKS)
    def test_expired_deadline_returns_promptly(self, harness: Harness) -> None:
        """A request whose deadline passed returns at once, and a short answer to it is a
        ``deadline`` (:class:`kvcore.FailureKind`), whatever the backend called it.

        .. versionchanged:: 0.3 the kind is checked
        """
        seq = harness.new_sequence(8)
        assert harness.write(seq) == 8
        fresh = harness.new_sequence(8)
        calls: dict[str, Callable[..., int]] = {
            "query": lambda **kw: harness.query(seq, **kw),
            "read": lambda **kw: harness.read(seq, **kw)[0],
            "write": lambda **kw: harness.write(seq, **kw),
            "write of new blocks": lambda **kw: harness.write(fresh, **kw),
        }
        for op, call in calls.items():
            t0 = time.monotonic()
            done = call(timeout_s=1e-6)
            assert time.monotonic() - t0 < self.deadline_slack_s
            assert 0 <= done <= 8
            if done < 8:
                assert getattr(done, "kind", None) == FailureKind.DEADLINE, (
                    f"an expired {op} answered {done!r} of kind {getattr(done, 'kind', None)!r}"
                )

    @exercises("kvcore_write", "kvcore_read", "kvcore_query")
    def test_deadline_expiring_mid_operation(self, open_harness: Callable[..., Harness]) -> None:
        """A deadline that passes while a large batch is in flight: the call returns near the
        deadline with the run finished so far, not when the whole batch is done.

        The batch grows until the backend's own time for it reaches a quarter second (or
        64 MiB of 1 KiB objects); the deadline is an eighth of the fastest time measured for
        the whole batch, and the call may overrun it by half that time (at most
        ``deadline_slack_s``). Up to four tries, each against the fastest time seen so far,
        so a loaded machine does not fail a backend that honours deadlines, while one that
        ignores them overruns every time. Calls run with Python's cyclic collector paused.
        """
        h = open_harness(deadline_layout())
        n = _grow_until_slow(h)
        written: list[Sequence_] = []
        try:
            self._check_deadline_overrun(h, n, "write", written)
            self._check_deadline_overrun(h, n, "read", written)
        finally:
            _remove_quietly(h, written)

    def _check_deadline_overrun(
        self, h: Harness, n: int, op: str, written: list[Sequence_]
    ) -> None:
        """Give ``op`` on ``n`` blocks a deadline at a fraction of the fastest full call seen;
        pass as soon as one call whose deadline passed mid-batch returns within the allowed
        overrun. ``written`` collects the sequences written (the reads use the first)."""
        call = h.backend.write if op == "write" else h.backend.read

        def fresh() -> Sequence_:
            if op == "read":
                return written[0]  # written in full by the write check
            written.append(h.new_sequence(n))
            return written[-1]

        # the fastest call that did the whole batch: noise (a collection, page faults on
        # fresh memory, a busy machine) only ever adds time
        done, t_full = _timed_call(h, call, h.bulk_request(fresh()))
        assert done == n, f"a {op} of {n} blocks with a {h.timeout_s} s deadline did {int(done)}"
        misses: list[str] = []
        for _ in range(_DEADLINE_ATTEMPTS):
            budget = t_full * _DEADLINE_FRACTION
            allowed = min(self.deadline_slack_s, t_full * _DEADLINE_OVERRUN_FRACTION)
            seq = fresh()
            request = replace(h.bulk_request(seq), deadline=time.monotonic() + budget)
            done, elapsed = _timed_call(h, call, request)
            assert 0 <= done <= n
            if op == "write":
                stored = h.query(seq)
                assert stored >= done, (
                    f"a write cut short by its deadline acknowledged {int(done)} blocks; a "
                    f"query right after counts {int(stored)}"
                )
            if done == n:
                t_full = min(t_full, elapsed)
                if elapsed <= budget:
                    continue  # done before the deadline: the batch was faster than measured
            if elapsed <= budget + allowed:
                return
            misses.append(
                f"{op} of {n} blocks: deadline {budget * 1e3:.1f} ms after the call, returned "
                f"after {elapsed * 1e3:.1f} ms with {int(done)} blocks (the whole batch takes "
                f"{t_full * 1e3:.1f} ms; allowed overrun {allowed * 1e3:.1f} ms)"
            )
        pytest.fail(
            "the backend kept working past the deadline: "
            + (
                "; ".join(misses)
                or f"no {op} ended after its deadline in {_DEADLINE_ATTEMPTS} tries"
            )
        )

    @exercises("kvcore_write", "kvcore_read")
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

    # -- events ------------------------------------------------------------------------------

    @exercises("kvcore_watch", "kvcore_write", "kvcore_remove", "kvcore_clear")
    def test_events_tell_what_was_stored_removed_and_cleared(
        self, open_harness: Callable[..., Harness]
    ) -> None:
        """The backend's event stream (``Backend.events``): a subscriber sees every object a
        write acknowledged, every object a remove deleted and a clear, in increasing sequence
        numbers, each event naming the backend's namespace and each object's part; writes
        made before it subscribed are not replayed. Works for every backend (kvcore publishes
        what passes through it); a backend that reports kinds itself (``kvcore_watch``) must
        report them as well."""
        h = open_harness(namespace=f"kvcore-kit-{uuid.uuid4().hex[:12]}")
        before = h.new_sequence(2)
        assert h.write(before) == 2
        seq = h.new_sequence(4)
        with h.backend.events.subscribe() as sub:
            acked = int(h.write(seq))
            assert acked == 4, f"write of 4 blocks acknowledged {acked}"
            names = _names(h.request(seq))
            index = StoreIndex()
            events = _take_events(h, sub, lambda: set(names) <= set(index.objects), index)
            stored = {n for e in events if e.kind == "stored" for n in e.names}
            assert set(names) <= stored, (
                f"stored events name {len(stored & set(names))} of the {len(names)} objects "
                "the write acknowledged"
            )
            assert not stored & set(_names(h.request(before))), (
                "a subscriber was told of writes made before it subscribed"
            )
            for e in events:
                _check_event(e, h.backend.context.namespace)
            if h.backend.implements("kvcore_remove"):
                assert h.backend.remove(h.request(seq, 2, 2)) == 2
                gone = set(_names(h.request(seq, 2, 2)))
                events += _take_events(h, sub, lambda: not gone & set(index.objects), index)
                assert not gone & set(index.objects), (
                    "after a remove, an index built from the events still holds "
                    f"{sorted(gone & set(index.objects))}"
                )
            if h.backend.implements("kvcore_clear"):
                assert h.backend.clear() >= 0
                events += _take_events(h, sub, lambda: not set(index.objects), index)
                assert not index.objects, (
                    f"after a clear, an index built from the events still holds "
                    f"{len(index.objects)} objects"
                )
            seqs = [e.seq for e in events]
            assert seqs == sorted(set(seqs)), f"sequence numbers do not increase: {seqs}"

    @exercises("kvcore_watch", "kvcore_write", "kvcore_query")
    def test_events_match_what_the_store_keeps_under_eviction(
        self,
        open_harness: Callable[..., Harness],
        backend_capacity: DeclaredCapacity | None,
    ) -> None:
        """For a backend that reports its own drops (``kvcore_watch``): write about twice its
        capacity; an index built only from the events then holds exactly the blocks a query
        finds (no block reported stored that is gone, none kept that was never reported)."""
        h, n = _twice_the_capacity(open_harness, backend_capacity)
        if not h.backend.implements("kvcore_watch"):
            pytest.skip("backend does not report what it drops (kvcore_watch, kvcore 0.3)")
        seqs = [h.new_sequence(4) for _ in range(max(1, n // 4))]
        with h.backend.events.subscribe() as sub:
            for seq in seqs:
                h.write(seq)
            index = StoreIndex()
            index.apply_all(sub.drain())
            wrong = []
            for seq in seqs:
                for i in range(len(seq.keys)):
                    held = bool(h.query(seq, i, 1))
                    told = set(_names(h.request(seq, i, 1))) <= set(index.objects)
                    if held != told:
                        wrong.append((seq.keys[i][:12], held, told))
            assert not wrong, (
                f"{len(wrong)} blocks where the store and the events disagree "
                f"(key, held, told by events): {wrong[:5]}"
            )
            assert index.resyncs == 0, "the subscription fell behind (resync) in a short test"

    @exercises("kvcore_evict_to", "kvcore_write", "kvcore_query")
    def test_what_the_store_evicts_is_handed_over_intact(
        self,
        open_harness: Callable[..., Harness],
        backend_capacity: DeclaredCapacity | None,
    ) -> None:
        """For a backend with ``kvcore_evict_to``: write about twice its capacity; every block
        written is then either still found, or was handed to the sink with every part's exact
        bytes (a store in front of another loses nothing it evicts)."""
        h, n = _twice_the_capacity(open_harness, backend_capacity)
        _require_hook(h.backend, "kvcore_evict_to")
        handed: dict[str, bytes] = {}

        def sink(objects: list[tuple[str, memoryview]]) -> None:
            for name, payload in objects:
                handed[name] = bytes(payload)  # valid only during the call: copied

        if not h.backend.evict_to(sink):
            pytest.skip("the backend says it cannot hand evictions over (kvcore_evict_to)")
        seqs = [h.new_sequence(4) for _ in range(max(1, n // 4))]
        for seq in seqs:
            assert h.write(seq) == 4
        h.backend.evict_to(None)
        assert handed, f"{len(seqs) * 4} blocks written over a capacity of ~{n // 2}: none handed"
        lost, wrong = [], []
        for seq in seqs:
            names = h.request(seq).object_names
            for i in range(4):
                if h.query(seq, i, 1):
                    continue
                for j, name in enumerate(names[i]):  # each part: still stored, or handed over
                    want = h.payload(seq, i, 1)[0][j]
                    if name in handed:
                        if handed[name] != want:
                            wrong.append(name)
                        continue
                    part = h.parts[j]
                    one = h.backend.request(
                        "kit-part", [seq.keys[i]], parts=(part,),
                        part_bytes=(h.layout.part_bytes(part),),
                    )  # fmt: skip
                    if not h.backend.query(one):
                        lost.append(name)
        assert not lost, f"{len(lost)} evicted objects were never handed over: {lost[:3]}"
        assert not wrong, f"{len(wrong)} objects were handed over with other bytes: {wrong[:3]}"

    @exercises("kvcore_evict_to", "kvcore_write", "kvcore_query")
    def test_what_the_sink_does_not_store_stays_in_the_store(
        self,
        open_harness: Callable[..., Harness],
        backend_capacity: DeclaredCapacity | None,
    ) -> None:
        """For a backend with ``kvcore_evict_to``: with a sink that stores nothing (a lower
        tier that is down), write about twice the capacity. Every block a write acknowledged
        is still found whole, no block is left with some of its parts, and each offer came
        with the write's deadline and held a block's parts together."""
        h, n = _twice_the_capacity(open_harness, backend_capacity)
        _require_hook(h.backend, "kvcore_evict_to")
        offers: list[tuple[list[str], float | None]] = []

        def sink(objects: list[tuple[str, memoryview]], deadline: float | None) -> list[str]:
            offers.append(([name for name, _ in objects], deadline))
            return []  # stored nothing: nothing may leave

        if not h.backend.evict_to(sink):
            pytest.skip("the backend says it cannot hand evictions over (kvcore_evict_to)")
        try:
            acked = []
            for _ in range(max(1, n // 4)):
                seq = h.new_sequence(4)
                acked.append((seq, int(h.write(seq))))
        finally:
            h.backend.evict_to(None)
        assert offers, f"{n} blocks written over a capacity of ~{n // 2}: nothing offered"
        assert all(deadline is not None for _, deadline in offers), "an offer without deadline"
        lost, split = [], []
        for seq, done in acked:
            names = h.request(seq).object_names
            for i in range(len(seq.keys)):
                found = [
                    bool(h.backend.query(h.backend.request(
                        "kit-part", [seq.keys[i]], parts=(p,),
                        part_bytes=(h.layout.part_bytes(p),),
                    )))
                    for p in h.parts
                ]  # fmt: skip
                if i < done and not all(found):
                    lost.append(names[i][0])
                elif any(found) and not all(found):
                    split.append(names[i][0])
        assert not lost, f"{len(lost)} acknowledged blocks left though the sink took nothing"
        assert not split, f"{len(split)} blocks left with only some of their parts: {split[:3]}"
        offered = {name for names, _ in offers for name in names}
        for offer, _ in offers:  # a block's parts in one offer
            rows = [r for seq, _ in acked for r in h.request(seq).object_names]
            for row in rows:
                if set(row) & set(offer):
                    assert set(row) <= set(offer), f"block {row[0]} offered part by part"
        assert offered

    # -- admission ---------------------------------------------------------------------------

    @exercises("kvcore_admit", "kvcore_write", "kvcore_read")
    def test_admission_answers_a_leading_run_and_admits_what_is_stored(
        self, harness: Harness
    ) -> None:
        backend = harness.backend
        _require_hook(backend, "kvcore_admit")
        admit = _hook_caller(backend, "kvcore_admit")
        seq = harness.new_sequence(4)
        first = admit(request=harness.request(seq))
        assert isinstance(first, int) and not isinstance(first, bool) and 0 <= first <= 4, (
            f"kvcore_admit of 4 blocks returned {first!r}; expected an int in [0, 4]"
        )
        assert harness.write(seq) == 4, "a write stores what it is given, asked about or not"
        again = admit(request=harness.request(seq))
        assert again == 4, f"blocks already stored must count as admitted, got {again!r}"
        assert backend.admit(harness.request(seq, 0, 0)) == 0
        harness.assert_reads_back(seq, 4)

    # -- removing data ---------------------------------------------------------------------

    @exercises("kvcore_remove", *DATA_HOOKS)
    def test_remove_deletes_the_requested_blocks(self, harness: Harness) -> None:
        backend, seq = _stored_for_removal(harness, 5)
        removed = backend.remove(harness.request(seq, 3, 2))
        assert removed == 2, f"remove of 2 stored blocks reported {int(removed)}"
        assert harness.query(seq, 3) == 0, "removed blocks are still found"
        assert harness.read(seq, 3)[0] == 0, "removed blocks can still be read"
        assert harness.query(seq) == 3, "remove of blocks 3-4 dropped blocks 0-2"
        harness.assert_reads_back(seq, 3)
        again = backend.remove(harness.request(seq, 3, 2))
        assert again == 0, f"a second remove of the same blocks reported {int(again)}"
        never = backend.remove(harness.request(harness.new_sequence(2)))
        assert never == 0, f"remove of never-stored blocks reported {int(never)}"
        partly = backend.remove(harness.request(seq))
        assert partly == 3, f"remove of 5 blocks of which 3 were stored reported {int(partly)}"
        assert harness.query(seq) == 0
        assert harness.write(seq) == 5, "blocks cannot be written again after a remove"
        harness.assert_reads_back(seq, 5)

    @requires(addressing="key")
    @exercises("kvcore_remove", *DATA_HOOKS)
    def test_remove_of_middle_blocks_keeps_the_others(self, harness: Harness) -> None:
        backend, seq = _stored_for_removal(harness, 5)
        assert backend.remove(harness.request(seq, 1, 2)) == 2
        assert harness.query(seq) == 1
        assert harness.query(seq, 3) == 2, "remove of blocks 1-2 dropped blocks 3-4"
        done, got = harness.read(seq, 3)
        assert done == 2 and blocks_equal(got, harness.payload(seq, 3, 2)) == []

    @exercises("kvcore_remove", "kvcore_write", "kvcore_query")
    def test_remove_is_per_rank_and_seen_by_every_instance(
        self,
        open_harness: Callable[..., Harness],
        backend_context: dict[str, Any],
    ) -> None:
        world, rank, other_rank, _ = _rank_layout(backend_context)
        own = open_harness(rank=rank, world_size=world)
        _require_hook(own.backend, "kvcore_remove")
        twin = open_harness(rank=rank, world_size=world)
        peer = open_harness(rank=other_rank, world_size=world)
        seq = own.new_sequence(3)
        assert own.write(seq) == 3
        assert peer.write(seq, version=1) == 3
        assert peer.backend.remove(peer.request(seq)) == 3
        assert peer.query(seq) == 0
        assert own.query(seq) == 3, f"rank {other_rank}'s remove dropped rank {rank}'s blocks"
        if _sees(twin, seq, 3):  # the instances share one store: removal is seen by all
            removed = twin.backend.remove(twin.request(seq))
            assert removed == 3
            left = own.query(seq)
            assert left == 0, (
                f"blocks removed through another instance sharing the store are still found "
                f"by this one ({int(left)} of 3)"
            )
            assert own.read(seq)[0] == 0

    @exercises("kvcore_clear", *DATA_HOOKS)
    def test_clear_empties_the_namespace_for_every_rank_and_no_other(
        self, open_harness: Callable[..., Harness]
    ) -> None:
        # namespaces of the kit's own: a clear must never touch data the kit did not write
        cleared_ns = f"kvcore-kit-{uuid.uuid4().hex[:12]}"
        kept_ns = f"{cleared_ns}-kept"
        own = open_harness(rank=0, world_size=2, namespace=cleared_ns)
        _require_hook(own.backend, "kvcore_clear")
        twin = open_harness(rank=0, world_size=2, namespace=cleared_ns)
        other_rank = open_harness(rank=1, world_size=2, namespace=cleared_ns)
        other_twin = open_harness(rank=1, world_size=2, namespace=cleared_ns)
        other_ns = open_harness(rank=0, world_size=2, namespace=kept_ns)
        seq = own.new_sequence(3)
        for version, h in enumerate((own, other_rank, other_ns)):
            assert h.write(seq, version=version) == 3
        # the other rank's blocks are held to the clear once another instance sees them: a
        # store whose writes reach the shared part later (a private first tier copying down
        # in the background) may not have them there yet, and one instance cannot clear
        # another's private memory
        shared = _sees(twin, seq, 3) and _sees(other_twin, seq, 3)
        objects = 3 * len(own.parts) * (2 if shared else 1)
        removed = own.backend.clear()
        assert removed == 0 or removed >= objects, (
            f"clear reported {int(removed)} objects removed; the namespace held at least "
            f"{objects} (0 is allowed for stores that cannot count)"
        )
        assert own.query(seq) == 0, "blocks are still found after clear"
        assert own.read(seq)[0] == 0, "blocks can still be read after clear"
        if shared:
            assert other_rank.query(seq) == 0, "clear left another rank's blocks in the namespace"
        done, got = other_ns.read(seq)
        assert done == 3, "clear removed blocks of another namespace"
        assert blocks_equal(got, other_ns.payload(seq, 0, 3, 2)) == []
        assert own.write(seq) == 3, "blocks cannot be written again after clear"
        done, got = own.read(seq)
        assert done == 3 and blocks_equal(got, own.payload(seq, 0, 3)) == []
        own.backend.clear()
        other_ns.backend.clear()

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
    @exercises("kvcore_write", "kvcore_read")
    def test_hostile_keys_are_data(self, harness: Harness, key: str) -> None:
        seq = harness.new_sequence(1)
        seq.keys[0] = f"{key}{seq.keys[0][:16]}"  # unique per run, still hostile
        written = harness.write(seq)
        assert written in (0, 1)
        if written:
            harness.assert_reads_back(seq, 1)

    @exercises()
    def test_unknown_config_field_is_named(
        self, backend_target: str | type, backend_config: dict[str, Any]
    ) -> None:
        with pytest.raises(ConfigError, match="no_such_setting"):
            open_backend(backend_target, {**backend_config, "no_such_setting": 1})

    @exercises()
    def test_bad_config_value_is_named(
        self, backend_target: str | type, backend_config: dict[str, Any]
    ) -> None:
        with pytest.raises(ConfigError, match="default_timeout_s"):
            open_backend(backend_target, {**backend_config, "default_timeout_s": -1})

    @exercises("kvcore_query", "kvcore_close")
    def test_opens_without_a_layout_for_queries(
        self,
        backend_target: str | type,
        backend_config: dict[str, Any],
        backend_context: dict[str, Any],
        harness: Harness,
        capabilities: Capabilities,
    ) -> None:
        """Tools that only look up or drop data (``kvcore check``, an operator's script) open
        a backend with ``layout=None``: it answers queries, or refuses with a ConfigError that
        says what it needs - never an AttributeError on None."""
        try:
            bare = _open_without_layout(backend_target, backend_config, backend_context)
        except ConfigError:
            return  # a clear refusal is allowed
        with bare:
            seq = harness.new_sequence(2)
            missing = bare.query(bare.request("kit-no-layout", seq.keys, token_ids=seq.token_ids))
            assert missing == 0
            if capabilities.shared and capabilities.addressing == "key":
                # same config and context but the layout: the same object names (k and v)
                assert harness.write(seq) == 2
                found = bare.query(bare.request("kit-no-layout", seq.keys))
                assert found == 2, "a backend opened without a layout misses stored blocks"

    # -- token index and lifecycle ---------------------------------------------------------

    @exercises("kvcore_flush_token_index", "kvcore_write", "kvcore_query")
    def test_flush_token_index_is_safe(self, harness: Harness, capabilities: Capabilities) -> None:
        seq = harness.new_sequence(3)
        assert harness.write(seq) == 3
        for resident in (True, False):
            n = harness.backend.flush_token_index(harness.request(seq, 1), resident)
            assert 0 <= n <= 2
            if not capabilities.token_index:
                assert n == 0
        assert harness.query(seq) == 3, "a flush must not move or drop data"

    @requires(checksums=False, addressing="key", io="host")
    @exercises("kvcore_write", "kvcore_read", "kvcore_query")
    def test_a_flipped_bit_is_never_read(
        self,
        backend_target: str | type,
        backend_config: dict[str, Any],
        backend_context: dict[str, Any],
    ) -> None:
        """Opened as every caller opens it (``verify_blocks="auto"``), a backend that keeps no
        checksums gets kvcore's block digests: a bit flipped in a stored object (through the
        backend's own hooks, as a failing store would) ends the read before that block, is
        counted, and the block is a miss afterwards (removed, where the backend can)."""
        from kvcore.testing.corruption import corrupt_reads, flip_a_stored_bit

        with harness_opener(
            backend_target, backend_config, backend_context, verify_blocks="auto"
        ) as open_:
            h = open_()
            if not h.backend.verifies_blocks:  # an instance may declare checksums (a stack)
                pytest.skip("the opened backend verifies its blocks itself")
            seq = h.new_sequence(3)
            assert h.write(seq) == 3
            name = h.request(seq).object_names[1][-1]
            flip_a_stored_bit(h.backend, name, h.layout.part_bytes(h.parts[-1]))
            done, got = h.read(seq)
            assert done == 1, f"read {int(done)} blocks past a corrupt one"
            assert blocks_equal(got[:1], h.payload(seq, 0, 1)) == []
            assert corrupt_reads(h.backend) == 1
            if h.backend.implements("kvcore_remove"):
                assert h.query(seq) == 1, "the corrupt block is still found"

    @exercises("kvcore_register_buffer", "kvcore_unregister_buffer", "kvcore_write", "kvcore_read")
    def test_registered_regions(self, harness: Harness) -> None:
        """Regions announced with ``register_buffer`` carry requests like any memory; data
        written from one outlives it (the region is reused once unregistered), and the same
        address can be registered again (allocators hand addresses out again)."""
        h, backend = harness, harness.backend
        seq = h.new_sequence(4)
        payload = h.payload(seq, 0, 4)
        src, dst = h.region(4, payload), h.region(4)
        for region in (src, dst):
            backend.register_buffer(region.ptr, region.nbytes)
        if h.io == "host":
            assert backend.write(h.request(seq, host=src.host())) == 4
            assert backend.read(h.request(seq, host=dst.host())) == 4
            assert blocks_equal(dst.blocks(), payload) == []
            # a request may use part of a region: blocks 1-2 into the region's blocks 2-3
            middle = h.region(4)
            backend.register_buffer(middle.ptr, middle.nbytes)
            assert backend.read(h.request(seq, 1, 2, host=middle.host(2, 2))) == 2
            assert blocks_equal(middle.blocks(2, 2), payload[1:3]) == []
            backend.unregister_buffer(middle.ptr)
        else:
            assert h.write(seq) == 4
        for region in (src, dst):
            backend.unregister_buffer(region.ptr)
            region.array[:] = 0xA5  # the engine reuses the memory
        done, got = h.read(seq)
        assert done == 4
        assert blocks_equal(got, payload) == [], "stored blocks changed with the freed region"
        again = h.new_sequence(4)
        backend.register_buffer(src.ptr, src.nbytes)
        if h.io == "host":
            src.array[:] = np.frombuffer(
                b"".join(b"".join(parts) for parts in h.payload(again, 0, 4)), dtype=np.uint8
            )
            assert backend.write(h.request(again, host=src.host())) == 4
        else:
            assert h.write(again) == 4
        backend.unregister_buffer(src.ptr)
        done, got = h.read(again)
        assert done == 4 and blocks_equal(got, h.payload(again, 0, 4)) == []

    @requires(io="host", segmented_host=True)
    @exercises(*DATA_HOOKS)
    def test_segmented_host_buffers_round_trip(
        self, open_harness: Callable[..., Harness], capabilities: Capabilities
    ) -> None:
        """Objects split into one segment per layer (an engine's host-resident cache) store
        the same bytes as contiguous staging regions, in both directions."""
        dtype = "block_wise_fp8" if capabilities.scales else "bfloat16"
        h = open_harness(small_layout(dtype))
        seq = h.new_sequence(4)
        payload = h.payload(seq, 0, 4)
        source, _ = h.segmented(4, payload)
        assert h.backend.write(h.request(seq, host=source)) == 4
        assert h.query(seq) == 4
        done, got = h.read(seq)  # contiguous
        assert done == 4
        assert blocks_equal(got, payload) == [], "segmented write stored other bytes"
        target, extract = h.segmented(4)
        assert h.backend.read(h.request(seq, host=target)) == 4
        assert blocks_equal(extract(), payload) == [], "segmented read returned other bytes"
        other = h.new_sequence(2)
        assert h.write(other) == 2  # contiguous
        target, extract = h.segmented(2)
        assert h.backend.read(h.request(other, host=target)) == 2
        assert blocks_equal(extract(), h.payload(other, 0, 2)) == []

    @exercises("kvcore_stats", "kvcore_write", "kvcore_read")
    def test_stats_are_a_flat_mapping_of_numbers(self, harness: Harness) -> None:
        seq = harness.new_sequence(2)
        harness.write(seq)
        harness.read(seq)
        backend = harness.backend
        if backend.implements("kvcore_stats"):
            own = _hook_caller(backend, "kvcore_stats")()
            assert isinstance(own, Mapping), f"kvcore_stats returned a {type(own).__name__}"
            bad = {k: v for k, v in own.items() if not (isinstance(k, str) and _is_number(v))}
            assert not bad, f"kvcore_stats must map str to numbers; these are not: {bad!r}"
        stats = backend.stats()
        assert stats["calls.write"] == 1
        assert stats["calls.read"] == 1
        bad = {k: v for k, v in stats.items() if not (isinstance(k, str) and _is_number(v))}
        assert not bad, f"Backend.stats() must map str to numbers; these are not: {bad!r}"

    @exercises("kvcore_raw_baseline")
    def test_raw_baseline_reports_speeds(self, harness: Harness) -> None:
        backend = harness.backend
        _require_hook(backend, "kvcore_raw_baseline")
        data = np.frombuffer(bytearray(np.random.default_rng().bytes(4 << 20)), dtype=np.uint8)
        before = data.copy()
        figures = backend.raw_baseline(data.ctypes.data, data.nbytes, data.nbytes // 16)
        assert isinstance(figures, Mapping)
        bad = {k: v for k, v in figures.items() if not (isinstance(k, str) and _is_number(v))}
        assert not bad, f"kvcore_raw_baseline must map str to numbers; these are not: {bad!r}"
        for name in ("write_gbps", "read_gbps"):
            if name in figures:
                assert math.isfinite(figures[name]) and figures[name] > 0, (name, figures)
        if "read_gbps" in figures:
            assert np.array_equal(data, before), "the raw baseline changed the bytes it was given"

    @exercises("kvcore_close")
    def test_close_is_idempotent(self, harness: Harness) -> None:
        harness.backend.close()
        harness.backend.close()


# -- helpers ---------------------------------------------------------------------------------


def _names(request: BlockRequest) -> list[str]:
    return [name for row in request.object_names for name in row]


def _take_events(
    h: Harness,
    sub: Any,
    done: Callable[[], bool],
    index: StoreIndex,
    timeout_s: float = 5.0,
) -> list[StoreEvent]:
    """Events from ``sub``, applied to ``index``, until ``done()`` (events a backend reports
    from its own threads may arrive a moment after the call that caused them)."""
    taken: list[StoreEvent] = []
    deadline = time.monotonic() + timeout_s
    while True:
        got = sub.drain()
        index.apply_all(got)
        taken += got
        if done() or time.monotonic() > deadline:
            return taken
        time.sleep(0.01)


def _check_event(event: StoreEvent, namespace: str) -> None:
    assert event.kind in KINDS, f"event kind {event.kind!r}"
    assert event.namespace == namespace, (
        f"event of namespace {event.namespace!r} on a backend opened for {namespace!r}"
    )
    assert len(event.sizes) == len(event.names) == len(event.parts) == len(event.objects), event
    for name, part, obj in zip(event.names, event.parts, event.objects, strict=True):
        # the identity the event carries is the name's, whoever built it
        assert obj is not None and obj.part == part and obj.format() == name, (name, part, obj)
        assert ObjectName.parse(name) == obj, (name, obj)


def _backend_class(target: str | type) -> type[Any]:
    return load_backend_class(target) if isinstance(target, str) else target


def _plain_rows(request: BlockRequest) -> BlockRequest:
    """The request with its object names as a tuple of tuples."""
    return replace(request, object_names=tuple(tuple(row) for row in request.object_names))


def _written_and_kept(h: Harness, seq: Sequence_, what: str) -> int:
    """Write ``seq``; assert a query right after finds at least what the write acknowledged
    (a write must never acknowledge blocks the store did not keep). Returns the count."""
    acked = h.write(seq)
    kept = h.query(seq)
    assert kept >= acked, (
        f"{what}: write acknowledged {int(acked)}, but a query right after counts {int(kept)}: "
        "a write must never acknowledge blocks the store did not keep"
    )
    return int(acked)


def _stored_for_removal(harness: Harness, n: int) -> tuple[Backend, Sequence_]:
    """The harness's backend (skipping when it has no ``kvcore_remove``) and ``n`` blocks
    written to it."""
    _require_hook(harness.backend, "kvcore_remove")
    seq = harness.new_sequence(n)
    assert harness.write(seq) == n
    return harness.backend, seq


def _twice_the_capacity(
    open_harness: Callable[..., Harness], capacity: DeclaredCapacity | None
) -> tuple[Harness, int]:
    """A harness on a store of the declared capacity, in a namespace of the kit's own, and
    how many blocks are about twice that capacity (skips without a declared capacity)."""
    if capacity is None:
        pytest.skip("no declared capacity (see the `backend_capacity` fixture)")
    n = 2 * capacity.nbytes // capacity_layout().block_bytes + 1
    h = open_harness(
        capacity_layout(max(n, 16)),
        config=capacity.config,
        namespace=f"kvcore-kit-{uuid.uuid4().hex[:12]}",
    )
    return h, n


def _require_hook(backend: Backend, hook: str) -> None:
    if not backend.implements(hook):
        pytest.skip(f"backend does not implement {hook}")


def _hook_caller(backend: Backend, hook: str) -> Callable[..., Any]:
    # the raw hook, not the facade: the facade normalises what it returns
    return getattr(backend.hook, hook)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _rank_layout(context: dict[str, Any]) -> tuple[int, int, int, str]:
    """(world size, this rank, another rank, namespace) for the configured context, with at
    least two ranks."""
    world = max(int(context.get("world_size", 1)), 2)
    rank = int(context.get("rank", 0)) % world
    return world, rank, (rank + 1) % world, str(context.get("namespace", "default"))


def _sees(h: Harness, seq: Sequence_, n: int) -> bool:
    """Whether ``h`` finds all ``n`` blocks of ``seq`` (written through another instance)."""
    return h.query(seq) == n


@contextlib.contextmanager
def _no_gc_pauses() -> Iterator[None]:
    """Keep Python's cyclic collector out of a timed call: in a big test process one full
    collection can take longer than the call, and it strikes calls at random."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _timed_call(
    h: Harness, call: Callable[[BlockRequest], int], request: BlockRequest
) -> tuple[int, float]:
    with _no_gc_pauses():
        t0 = time.monotonic()
        done = call(request)
        elapsed = time.monotonic() - t0
    h.release()
    return done, elapsed


def _grow_until_slow(h: Harness) -> int:
    """A batch whose write takes about the target time, or the largest one the store takes
    whole: start at 256 blocks and scale by the measured time, 2-4x a step.
    A store may refuse a batch too large for it (a short count); the last whole one is used."""
    n, whole = 256, 0
    while True:
        seq = h.new_sequence(n)
        done, elapsed = _timed_call(h, h.backend.write, h.bulk_request(seq))
        _remove_quietly(h, [seq])
        if done < n:
            assert whole, (
                f"a write of {n} fresh blocks with a {h.timeout_s} s deadline stored "
                f"{int(done)} (failure: {getattr(done, 'failure', None)!r})"
            )
            return whole
        whole = n
        if elapsed >= _DEADLINE_TARGET_S or n >= _DEADLINE_MAX_BLOCKS:
            return n
        # at most 4x a step: a backend whose cost grows faster than the batch (work per
        # slice that depends on the whole token path) must not jump far past the target
        scale = min(4.0, max(2.0, 1.5 * _DEADLINE_TARGET_S / max(elapsed, 1e-3)))
        n = min(int(n * scale), _DEADLINE_MAX_BLOCKS)


def _remove_quietly(h: Harness, seqs: list[Sequence_]) -> None:
    """Drop what a test wrote in bulk, where the backend can, so shared stores do not fill."""
    if not h.backend.implements("kvcore_remove"):
        return
    for seq in seqs:
        with contextlib.suppress(Exception):
            h.backend.remove(h.request(seq))
