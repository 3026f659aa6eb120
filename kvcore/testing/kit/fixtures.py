"""What every kit mixin relies on: :class:`KitFixtures` (the class attributes a backend's
test class sets, the fixtures it overrides and the fixtures the kit provides), the opener of
strict harnesses, the layouts and declared capacity the tests open stores with, and the
helpers several mixins share."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from kvcore.backend import Backend, VerifyBlocks
from kvcore.handles import BackendHandle
from kvcore.registry import load_backend_class
from kvcore.schemas import CacheDType, CacheLayout, Capabilities
from kvcore.testing.harness import Harness, Sequence_

__all__ = [
    "DeclaredCapacity",
    "KitFixtures",
    "capacity_layout",
    "harness_opener",
    "small_layout",
]


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


class KitFixtures:
    """The base of every kit mixin: set ``backend``; override the ``backend_*`` fixtures.

    A test class composing only some mixins gets these fixtures through any of them."""

    #: entry-point name of the backend under test, or its class
    backend: ClassVar[str | type | None] = None

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


# -- helpers ---------------------------------------------------------------------------------


def _open_without_layout(
    target: str | type, config: dict[str, Any], context: dict[str, Any]
) -> Backend:
    """The backend opened as tools open it: ``layout=None`` (strict: hook errors raise)."""
    return BackendHandle(
        target, config, context={**context, "layout": None}, strict=True, verify_blocks="never"
    ).open()


def _backend_class(target: str | type) -> type[Any]:
    return load_backend_class(target) if isinstance(target, str) else target


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


def _rank_layout(context: dict[str, Any]) -> tuple[int, int, int, str]:
    """(world size, this rank, another rank, namespace) for the configured context, with at
    least two ranks."""
    world = max(int(context.get("world_size", 1)), 2)
    rank = int(context.get("rank", 0)) % world
    return world, rank, (rank + 1) % world, str(context.get("namespace", "default"))


def _sees(h: Harness, seq: Sequence_, n: int) -> bool:
    """Whether ``h`` finds all ``n`` blocks of ``seq`` (written through another instance)."""
    return h.query(seq) == n
