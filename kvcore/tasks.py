"""The TransferManager's task API: the tasks an engine submits and the result of each.

``QueryTask``, ``ReadTask``, ``WriteTask``, ``FlushTask`` and ``SwapTask`` are what an engine
submits, validated when built (non-empty keys, one device block per key, ids that pair up);
``TaskResult`` says what a task did and why it ended as it did. ``kvcore.schemas`` re-exports
all of them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from typing_extensions import Self

from kvcore.blockmeta import check_block_meta
from kvcore.config import StrictModel, timeout_field
from kvcore.tenants import check_tenant_name

__all__ = [
    "FlushTask",
    "QueryTask",
    "ReadTask",
    "SwapTask",
    "TaskOp",
    "TaskOutcome",
    "TaskResult",
    "WriteTask",
]


class _TaskBase(StrictModel):
    task_id: str = Field(min_length=1)
    timeout_s: float | None = timeout_field(None, "None: the manager's default timeout")


class _TenantField(StrictModel):
    """``tenant``: whose request it is, by the operator's name for it (an engine adapter maps a
    request's ``cache_salt`` or its own parameter to it with :class:`kvcore.tenants.
    TenantSettings`; a salt never travels here); counted per tenant. None: none named.

    .. versionadded:: 0.3
    """

    tenant: str | None = None

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, value: str | None) -> str | None:
        return None if value is None else check_tenant_name(value)


class _SliceFields(StrictModel):
    """Which slice of each block the task's objects hold, when not the manager's own.

    By default a task's objects are named for the backend context's rank and world size.
    ``rank`` and ``world_size`` name another slice: one KV head of a layout that does not
    depend on the tensor-parallel degree (slice ``h`` of the model's ``H`` KV heads), or a
    cache every rank holds whole (MLA's latent: rank 0 of 1). Both or neither.

    .. versionadded:: 0.3
    """

    rank: int | None = Field(default=None, ge=0)
    world_size: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _slice(self) -> Self:
        if (self.rank is None) != (self.world_size is None):
            given = "rank" if self.world_size is None else "world_size"
            raise ValueError(f"{given} given alone: a slice is a rank and a world_size")
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        return self


class QueryTask(_TaskBase, _SliceFields, _TenantField):
    """Count the stored leading run of ``keys`` (blocks ``start_block ..``) on this rank.

    A query moves no data, so it names no device blocks.

    .. versionadded:: 0.2 (0.1 queried with a :class:`ReadTask`; its ``device_block_ids`` are
       still accepted here, and ignored, for one release)
    .. versionchanged:: 0.3 ``rank`` and ``world_size`` (:class:`_SliceFields`).
    """

    keys: list[str]
    token_ids: list[int] | None = None
    start_block: int = Field(default=0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _accept_read_task_form(cls, data: Any) -> Any:
        if isinstance(data, dict) and "device_block_ids" in data:
            data = {k: v for k, v in data.items() if k != "device_block_ids"}
        return data

    @model_validator(mode="after")
    def _keys(self) -> Self:
        _check_keys(self.keys)
        return self


class _BlockTask(_TaskBase, _SliceFields, _TenantField):
    """Blocks ``start_block .. start_block + len(keys)`` paired with device blocks.

    ``keys[i]`` is the chained hash of block ``start_block + i``, held in device block
    ``device_block_ids[i]``; ``token_ids`` is the full token path from the root (required by
    token-addressed backends).

    .. versionchanged:: 0.3 ``rank`` and ``world_size`` (:class:`_SliceFields`).
    """

    keys: list[str]
    device_block_ids: list[int]
    token_ids: list[int] | None = None
    start_block: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _lengths(self) -> Self:
        _check_block_lists(self.keys, self.device_block_ids)
        return self


class ReadTask(_BlockTask):
    """Restore the stored leading run of ``keys`` into ``device_block_ids``.

    ``expected_s``: how long the load was expected to take when it was chosen
    (:attr:`kvcore.load_costs.LoadChoice.expected_s`). Given, the manager reads in short spans
    and stops once the load falls behind it by more than the slack
    (:class:`kvcore.load_costs.LoadPace`): the blocks not read are answered as not restored
    (outcome ``cut``) and the engine recomputes them, so a store that slows down mid-load
    costs about the estimate, not the slow read. None: read until done or the deadline.

    ``break_even_s``: the read time at which loading ties with recomputing
    (:attr:`kvcore.load_costs.LoadChoice.break_even_s`). Given with ``expected_s``, a load
    whose own rate, once it has read a few spans, says it would end past it is cut the same
    way (:meth:`kvcore.load_pace.LoadPace.losing`): an estimate from a few short reads can be
    optimistic, and the blocks read by then are kept.

    ``caller_idle``: the engine waits for this load with nothing computing meanwhile (a load
    made before its step computes), so the backend may wait for its transfers at the lowest
    CPU priority (:attr:`kvcore.BlockRequest.caller_idle`). False (the default) for a load the
    engine computes beside.

    .. versionchanged:: 0.3 ``expected_s``, ``break_even_s``, ``caller_idle``.
    """

    expected_s: float | None = Field(default=None, gt=0)
    break_even_s: float | None = Field(default=None, gt=0)
    caller_idle: bool = False


class WriteTask(_BlockTask):
    """Store the blocks held in ``device_block_ids`` under ``keys``.

    ``block_meta``: what each block says of itself (see
    :attr:`kvcore.BlockRequest.block_meta`), one ``bytes`` per key, kept by backends that
    store it.

    .. versionchanged:: 0.2 a sibling of :class:`ReadTask`, no longer its subclass.
    .. versionchanged:: 0.3 ``block_meta``.
    """

    block_meta: list[bytes] | None = None

    @model_validator(mode="after")
    def _meta(self) -> Self:
        if self.block_meta is not None:
            check_block_meta(self.block_meta, len(self.keys))
        return self


class FlushTask(_TaskBase):
    """Update a token index's residency record for blocks from ``start_block`` (seed 003).

    The blocks are those of ``token_ids`` from ``start_block`` to the last full block; ``keys``
    may name them too, for backends that want both.
    """

    token_ids: list[int]
    keys: list[str] = Field(default_factory=list)
    start_block: int = Field(default=0, ge=0)
    resident_on_device: bool


class SwapTask(_TaskBase):
    """Copy (device block, host block) pairs between device cache and the host cache."""

    direction: Literal["to_host", "to_device"]
    device_block_ids: list[int]
    host_block_ids: list[int]

    @model_validator(mode="after")
    def _lengths(self) -> SwapTask:
        if len(self.device_block_ids) != len(self.host_block_ids):
            raise ValueError(
                f"device_block_ids has {len(self.device_block_ids)} ids but host_block_ids has "
                f"{len(self.host_block_ids)}; they are pairs"
            )
        return self


def _check_keys(keys: list[str]) -> None:
    if "" in keys:  # one C-level scan; the index only when it fails
        raise ValueError(f"keys[{keys.index('')}] is empty")


def _check_block_lists(keys: list[str], device_block_ids: list[int]) -> None:
    if len(keys) != len(device_block_ids):
        raise ValueError(
            f"keys has {len(keys)} entries but device_block_ids has {len(device_block_ids)}; "
            "one device block per key"
        )
    _check_keys(keys)
    if device_block_ids and min(device_block_ids) < 0:
        i = next(i for i, b in enumerate(device_block_ids) if b < 0)
        raise ValueError(f"device_block_ids[{i}] = {device_block_ids[i]} is negative")


#: What a task did (:attr:`TaskResult.op`).
TaskOp = Literal["read", "write", "query", "flush", "swap_to_host", "swap_to_device"]

#: Why a task ended as it did (:attr:`TaskResult.outcome`).
#:
#: .. versionchanged:: 0.3 ``corrupt``: blocks read differed from their digests (were never
#:    delivered); it was reported as ``backend_error``. ``cut``: a load that fell behind its
#:    expected time (:attr:`ReadTask.expected_s`) was stopped
TaskOutcome = Literal[
    "complete",
    "miss",
    "backend_error",
    "invalid_result",
    "deadline",
    "corrupt",
    "rejected",
    "error",
    "cut",
]


class TaskResult(StrictModel):
    """Outcome of one task: what was done, how many bytes, how long each stage took.

    ``outcome`` says why the task ended: ``complete`` (everything asked for was done),
    ``miss`` (the backend answered fewer blocks, without reporting a failure: the data is not
    there or did not fit), ``backend_error`` (the backend raised or reported a failure),
    ``invalid_result`` (it broke the hook contract), ``deadline`` (answered at the deadline with
    what was done by then), ``corrupt`` (a block read differed from its digest: it and the
    blocks after it were not delivered), ``cut`` (a load behind its expected time, stopped: the
    blocks not read are the engine's to recompute), ``rejected`` (not run: queue full, caches cleared, closing) or
    ``error`` (the task itself failed in kvcore; ``error`` says how). ``error`` carries the
    detail whenever the outcome is not ``complete`` or ``miss``.
    """

    task_id: str
    op: TaskOp
    outcome: TaskOutcome = "complete"
    ok: bool = True
    num_blocks: int = 0
    block_ids: list[int] = Field(default_factory=list, description="device block ids done")
    skipped_blocks: int = Field(default=0, description="write: already stored, not rewritten")
    refused_blocks: int = Field(
        default=0,
        description="write: not admitted by the backend's admission policy, so not written "
        "(not a failure; see kvcore.admission)",
    )
    bytes: int = 0
    error: str | None = None
    deadline_missed: bool = False
    timings_s: dict[str, float] = Field(default_factory=dict)
