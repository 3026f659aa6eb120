"""Settings of a :class:`~kvcore.transfer.TransferManager`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from kvcore.config import EnvConfig, timeout_field
from kvcore.errors import ConfigError
from kvcore.schemas import BackendContext, ByteSize, CacheLayout

if TYPE_CHECKING:
    from kvcore.backend import Backend

__all__ = ["TransferConfig"]

#: Engine facts that live in the config's ``context`` but may be given at top level (the 0.1
#: form, still what most engines write): ``{"layout": ..., "rank": 1, "max_model_len": ...}``.
_CONTEXT_FIELDS = ("layout", "rank", "world_size", "device_id", "namespace", "weight_version")


class TransferConfig(EnvConfig):
    """How the manager sizes its buffers, threads and queues, and when it writes back.

    ``context`` is the engine a backend is opened for (layout, rank, world size, device,
    namespace, weight version): the manager opens its backend with exactly this context, or
    checks that an opened one has it. Its fields may also be given at top level.

    Every field can be overridden with ``KVCORE_TRANSFER_<FIELD>`` (e.g.
    ``KVCORE_TRANSFER_WRITE_WORKERS=4``, ``KVCORE_TRANSFER_RANK=1``); the environment wins over
    the given config.
    """

    env_prefix = "KVCORE_TRANSFER_"
    env_extra_fields: ClassVar[tuple[str, ...]] = _CONTEXT_FIELDS

    context: BackendContext
    max_model_len: int = Field(gt=0, description="longest sequence in tokens: bounds a task")
    num_host_blocks: int = Field(default=0, ge=0, description="host (swap) cache blocks; 0: none")

    write_policy: Literal["write_through", "selective"] = "write_through"
    selective_min_hits: int = Field(
        default=2, ge=1, description="selective: write a block once it has been used this often"
    )
    hit_table_size: int = Field(default=1_000_000, ge=1, description="keys whose hits are tracked")

    swap_workers: int = Field(default=1, ge=1)
    read_workers: int = Field(default=2, ge=1)
    write_workers: int = Field(default=2, ge=1)
    queue_depth: int = Field(default=64, ge=1, description="tasks waiting per direction")
    submit_wait_s: float = Field(
        default=1.0, ge=0, le=3600, description="back-pressure wait when a queue is full"
    )
    storage_io: Literal["auto", "staged", "host_resident", "device"] = Field(
        default="auto",
        description="how blocks reach the backend: auto picks device (io='device' backends), "
        "host_resident (a host cache and a backend taking segmented buffers: no staging copy) "
        "or staged (through host staging buffers)",
    )
    staging_buffers: int | None = Field(
        default=None, ge=1, description="staging buffers per direction (default: workers + 1)"
    )
    pipeline_blocks: int = Field(
        default=16,
        ge=1,
        description="blocks per span at most: the storage I/O of one span overlaps the device "
        "copy of the next (writes) or the previous (reads); smaller if the budget says so",
    )
    staging_budget_bytes: ByteSize = Field(
        default=ByteSize(2**30),
        gt=0,
        description="host memory the staged path may allocate, both directions together "
        "(e.g. '1GiB', '512MB'): spans shrink to fit it",
    )
    prefault_staging: bool = Field(
        default=False,
        description="touch every staging page at construction (first tasks run at full speed; "
        "the memory is committed whether or not it is ever used)",
    )
    pipeline_depth: int = Field(
        default=2, ge=2, le=8, description="spans in flight per task (staging slots per task)"
    )
    default_timeout_s: float | None = timeout_field(
        None, "deadline of a task that sets none; None: the backend config's default_timeout_s"
    )
    fence_grace_s: float = Field(
        default=2.0,
        ge=0,
        le=3600,
        description="host-resident I/O: how long past its deadline a task's answer waits for a "
        "backend call still touching the engine's blocks",
    )
    verify_blocks: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="store a digest beside each block and check every block read against it: "
        "auto does so for backends that keep no checksum of their own "
        "(Capabilities.checksums false), so a corrupted object is a miss, never wrong KV; "
        "it is the backend's setting (open_backend's verify_blocks): passed on when the "
        "manager opens the backend, checked against an opened one when not auto",
    )
    flush_after_read: bool = Field(
        default=True, description="token-index backends: mark restored blocks device-resident"
    )
    strict: bool = Field(default=False, description="let backend exceptions propagate (tests)")

    @model_validator(mode="before")
    @classmethod
    def _context_at_top_level(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        moved = {k: data[k] for k in _CONTEXT_FIELDS if k in data}
        if not moved:
            # no engine facts at all: the check below names what is missing (the layout),
            # not the internal field that would hold it
            return data if "context" in data else {**data, "context": {}}
        rest = {k: v for k, v in data.items() if k not in moved}
        context = rest.get("context") or {}
        if isinstance(context, BackendContext):
            context = context.model_dump(exclude_unset=True)
        rest["context"] = {**context, **moved}
        return rest

    @model_validator(mode="after")
    def _needs_layout(self) -> TransferConfig:
        if self.context.layout is None:
            raise ValueError(
                "layout: missing: the engine's cache layout (num_layers, num_heads, block_size, "
                "head_dim, dtype), as `layout` or `context.layout`; the manager sizes "
                "everything from it"
            )
        return self

    # the engine facts, as 0.1 callers read them
    @property
    def layout(self) -> CacheLayout:
        assert self.context.layout is not None
        return self.context.layout

    rank = property(lambda self: self.context.rank, doc="``context.rank``")
    world_size = property(lambda self: self.context.world_size, doc="``context.world_size``")
    namespace = property(lambda self: self.context.namespace, doc="``context.namespace``")
    device_id = property(lambda self: self.context.device_id, doc="``context.device_id``")

    @property
    def max_task_blocks(self) -> int:
        """The most blocks one task may carry: the longest sequence, in blocks."""
        return math.ceil(self.max_model_len / self.layout.block_size)

    def staging_count(self, workers: int) -> int:
        return self.staging_buffers or workers + 1

    @property
    def span_blocks(self) -> int:
        """Blocks per span of the staged path: ``pipeline_blocks``, or fewer so that every
        staging buffer fits ``staging_budget_bytes``:

            staging bytes = (read buffers + write buffers) x pipeline_depth x span x block bytes

        with ``read_workers + 1`` and ``write_workers + 1`` buffers unless ``staging_buffers``
        says otherwise. Raises ConfigError when the budget cannot hold a span of one block.
        """
        count = self.staging_count(self.read_workers) + self.staging_count(self.write_workers)
        per_block = count * self.pipeline_depth * self.layout.block_bytes
        fits = self.staging_budget_bytes // per_block
        if fits < 1:
            raise ConfigError(
                f"invalid transfer config:\n  staging_budget_bytes: {self.staging_budget_bytes} "
                f"bytes cannot hold one task: {count} staging buffers x pipeline_depth "
                f"{self.pipeline_depth} x one {self.layout.block_bytes}-byte block need "
                f"{per_block} bytes (raise the budget, or lower the workers or staging_buffers)"
            )
        return min(self.pipeline_blocks, self.max_task_blocks, fits)

    @property
    def staging_slots(self) -> int:
        """Blocks one staging buffer holds: ``pipeline_depth`` spans."""
        return self.pipeline_depth * self.span_blocks

    def check_backend(self, backend: Backend) -> None:
        """An already-opened backend must have been opened for this engine: its context names
        the stored objects, so a mismatch would silently miss (or mix ranks or weights)."""
        mine, theirs = self.context, backend.context
        if theirs.role != "data":
            raise ConfigError(
                f"invalid transfer config: backend {backend.name!r} was opened for lookups "
                f"(context role {theirs.role!r}); a transfer manager moves blocks: open it with "
                "role 'data'"
            )
        for field in ("rank", "world_size", "namespace", "layout", "weight_version"):
            if field == "layout" and (
                theirs.layout is None
                or (mine.layout is not None and mine.layout.stores_like(theirs.layout))
            ):
                continue  # the same stored objects, whatever the layers (see stores_like)
            ours = getattr(mine, field)
            other = backend.weight_version if field == "weight_version" else getattr(theirs, field)
            if ours != other:
                raise ConfigError(
                    f"invalid transfer config:\n  {field}: {ours!r} differs from the backend's "
                    f"context ({other!r}); open the backend with the same {field}, or pass its "
                    "name"
                )
        if self.verify_blocks != "auto" and self.verify_blocks != backend.verify_blocks:
            raise ConfigError(
                f"invalid transfer config:\n  verify_blocks: {self.verify_blocks!r} differs "
                f"from the opened backend's ({backend.verify_blocks!r}); an opened backend keeps "
                "its digests for every caller, so open it with "
                f"open_backend(..., verify_blocks={self.verify_blocks!r}), or pass its name"
            )
