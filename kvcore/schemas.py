"""Pydantic schemas: what describes an engine's KV cache and a backend.

``CacheLayout`` (the shape of one rank's cache), ``CacheDType``, ``Capabilities`` (what a backend
can do), ``BackendContext`` (the engine a backend is opened for) and ``check_weight_version``.

Every model forbids unknown fields so a typo in a config or a task is an error that names the
field instead of a silently ignored setting.

It also re-exports the names that moved out of it, so ``from kvcore.schemas import ...`` keeps
working: configuration (``StrictModel``, ``EnvConfig``, ``BackendConfig``, ``timeout_field``,
``interval_field``, ``MAX_TIMEOUT_S``, ``parse_config_arg``) from :mod:`kvcore.config`, the task
API (``QueryTask``, ``ReadTask``, ``WriteTask``, ``FlushTask``, ``SwapTask``, ``TaskResult``,
``TaskOp``, ``TaskOutcome``) from :mod:`kvcore.tasks`.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Literal

from pydantic import ByteSize, ConfigDict, Field, field_validator, model_validator

from kvcore.config import (
    MAX_TIMEOUT_S,
    BackendConfig,
    EnvConfig,
    StrictModel,
    interval_field,
    parse_config_arg,
    timeout_field,
)
from kvcore.tasks import (
    FlushTask,
    QueryTask,
    ReadTask,
    SwapTask,
    TaskOp,
    TaskOutcome,
    TaskResult,
    WriteTask,
)

__all__ = [
    "MAX_TIMEOUT_S",
    "BackendConfig",
    "BackendContext",
    "ByteSize",
    "CacheDType",
    "CacheLayout",
    "Capabilities",
    "EnvConfig",
    "FlushTask",
    "QueryTask",
    "ReadTask",
    "StrictModel",
    "SwapTask",
    "TaskOp",
    "TaskOutcome",
    "TaskResult",
    "WriteTask",
    "check_weight_version",
    "interval_field",
    "parse_config_arg",
    "timeout_field",
]

_WEIGHT_VERSION_RE = re.compile(r"^[A-Za-z0-9._-]{0,64}$")


def check_weight_version(value: str) -> str:
    """A weight version ends every object name, so it is a short token, never a path."""
    if not isinstance(value, str) or not _WEIGHT_VERSION_RE.match(value):
        raise ValueError(
            f"weight_version {value!r} must be at most 64 characters from [A-Za-z0-9._-]"
        )
    return value


class CacheDType(str, Enum):
    """Element type of the KV cache. ``block_wise_fp8`` stores 1-byte elements plus scales (of
    the layout's ``scale_dtype``)."""

    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"  # CPU engines serve small models in float32 (.. versionadded:: 0.2)
    uint8 = "uint8"
    block_wise_fp8 = "block_wise_fp8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZES.get(self.value, 1)

    @property
    def has_scales(self) -> bool:
        return self is CacheDType.block_wise_fp8


_ITEMSIZES = {"bfloat16": 2, "float16": 2, "float32": 4}

#: Element types block-wise fp8 scales may have (one scale per head and token), and their sizes.
#: FastDeploy allocates them in the model's default dtype, so 2-byte scales are common.
SCALE_ITEMSIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


class CacheLayout(StrictModel):
    """Shape of one rank's KV cache.

    Per layer the engine holds one K and one V tensor ``[num_blocks, num_heads, block_size,
    head_dim]`` and, for ``block_wise_fp8``, scale tensors ``[num_blocks, num_heads, block_size]``.
    Extra layers (e.g. an MTP draft model's) follow the main layers and may have their own
    block count. A stored object holds one block of one part (K, V, K scales or V scales) for all
    layers, in the staging layout ``[layer, head, block_size, head_dim]``.
    """

    num_layers: int = Field(gt=0, description="main model layers on this rank")
    num_heads: int = Field(gt=0, description="KV heads on this rank")
    block_size: int = Field(gt=0, description="tokens per block")
    head_dim: int = Field(gt=0)
    dtype: CacheDType = CacheDType.bfloat16
    scale_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="element type of block-wise fp8 scales (ignored for other dtypes)",
    )
    num_blocks: int = Field(
        default=0, ge=0, description="device blocks per main layer (0: unknown)"
    )
    num_extra_layers: int = Field(default=0, ge=0)
    extra_num_blocks: int | None = Field(
        default=None, ge=0, description="device blocks per extra layer (default: num_blocks)"
    )

    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_extra_layers

    @property
    def parts(self) -> tuple[str, ...]:
        """Names of the objects stored per block, in staging order."""
        return ("k", "v", "k_scale", "v_scale") if self.dtype.has_scales else ("k", "v")

    @property
    def kv_block_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.block_size, self.head_dim)

    @property
    def scale_block_shape(self) -> tuple[int, int]:
        return (self.num_heads, self.block_size)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """Shape of one main layer's K (or V) cache tensor."""
        return (self.num_blocks, *self.kv_block_shape)

    @property
    def scale_shape(self) -> tuple[int, int, int]:
        return (self.num_blocks, *self.scale_block_shape)

    @property
    def kv_layer_block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.num_heads * self.block_size * self.head_dim * self.dtype.itemsize

    @property
    def scale_itemsize(self) -> int:
        return SCALE_ITEMSIZES[self.scale_dtype]

    def part_itemsize(self, part: str) -> int:
        """Element size of one part's tensors: the cache dtype's for K and V, else the scales'."""
        return self.dtype.itemsize if part in ("k", "v") else self.scale_itemsize

    @property
    def scale_layer_block_bytes(self) -> int:
        if not self.dtype.has_scales:
            return 0
        return self.num_heads * self.block_size * self.scale_itemsize

    def layer_block_bytes(self, part: str) -> int:
        return self.kv_layer_block_bytes if part in ("k", "v") else self.scale_layer_block_bytes

    def part_bytes(self, part: str) -> int:
        """Bytes of one stored object: one block of ``part`` across all layers."""
        return self.layer_block_bytes(part) * self.total_layers

    def stores_like(self, other: CacheLayout) -> bool:
        """Whether blocks described by ``other`` are the same stored objects: the same parts,
        each of the same size, and the same tokens per block and element type.

        How an engine carves a block into layers is its own business: a cache whose blocks
        hold K and V together may describe each block as halves of its layer list (half the
        layers, each twice as wide) to move fewer, larger pieces, while the rest of the engine
        describes it layer by layer.

        .. versionadded:: 0.2
        """
        return (
            self.parts == other.parts
            and all(self.part_bytes(p) == other.part_bytes(p) for p in self.parts)
            and (self.block_size, self.dtype, self.scale_dtype)
            == (other.block_size, other.dtype, other.scale_dtype)
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all parts and layers (what a stored block costs)."""
        return sum(self.part_bytes(p) for p in self.parts)

    def layer_num_blocks(self, layer: int) -> int:
        if layer < self.num_layers:
            return self.num_blocks
        return self.num_blocks if self.extra_num_blocks is None else self.extra_num_blocks


class Capabilities(StrictModel):
    """What a backend can do; the conformance kit selects its tests from these.

    ``addressing``: ``"key"`` backends store objects by name (block hash, part, rank);
    ``"token"`` backends index blocks by the token path from the root and a start block.
    ``io``: ``"host"`` backends read and write host staging memory; ``"device"`` backends
    read and write the engine's per-layer cache tensors by pointer and block id.
    ``segmented_host``: a host backend that handles :class:`kvcore.HostBuffers` whose objects
    are split into per-layer segments (``HostBuffers.segments``/``views``); kvcore then reads
    and writes an engine's host-resident cache blocks in place, with no staging copy.

    ``checksums``: the backend verifies every object it returns (kv_file does); otherwise
    the transfer manager keeps a digest beside each block and verifies reads itself.

    ``block_meta``: the backend stores each block's metadata (``BlockRequest.block_meta``)
    with its objects and returns it from ``kvcore_describe``, to any process.

    ``lookup_reads``: opened for lookups (:attr:`BackendContext.role` ``"lookup"``), the
    backend still reads into host memory registered with it (a Mooncake client that mounts no
    segment reads the others'; a file backend reads its files). kvcore then lets a scheduler
    read a few blocks to measure the store's rate before its first load-or-recompute decision
    (:func:`kvcore.load_costs.probe_read`); writes through such a backend stay refused.

    .. versionchanged:: 0.2 ``segmented_host``, ``checksums``.
    .. versionchanged:: 0.3 ``block_meta``, ``lookup_reads``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    addressing: Literal["key", "token"] = "key"
    io: Literal["host", "device"] = "host"
    token_index: bool = False
    persistent: bool = False
    shared: bool = False
    scales: bool = True
    concurrent: bool = True
    segmented_host: bool = False
    checksums: bool = False
    block_meta: bool = False
    lookup_reads: bool = False


#: What a backend is opened for (:attr:`BackendContext.role`)
BackendRole = Literal["data", "lookup"]


class BackendContext(StrictModel):
    """Facts about the engine a backend is opened for, passed to its constructor.

    .. versionchanged:: 0.3 ``role``: ``"lookup"`` opens a backend that only answers
       queries (an engine's scheduler, which moves no data). Such a backend may leave out
       what moving data needs (Mooncake: no memory segment, no copy buffer); kvcore refuses
       writes through it, and reads unless it says it can (``Capabilities.lookup_reads``).
       Backends written before 0.3 ignore the field.
    """

    layout: CacheLayout | None = None
    rank: int = Field(default=0, ge=0)
    world_size: int = Field(default=1, ge=1)
    device_id: int = Field(default=0, ge=0)
    namespace: str = "default"
    role: BackendRole = Field(
        default="data",
        description="data: reads, writes and queries; lookup: queries only (no data "
        "buffers need be set up; reads and writes are refused)",
    )
    weight_version: str = Field(
        default="",
        description="model-weight version ending every object name ('' for none); change it at "
        "runtime with Backend.set_weight_version",
    )

    @field_validator("weight_version")
    @classmethod
    def _weight_version(cls, value: str) -> str:
        return check_weight_version(value)

    @model_validator(mode="after")
    def _rank_in_world(self) -> BackendContext:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        return self
