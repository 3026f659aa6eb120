"""Pydantic schemas: cache layout, engine-facing tasks and results, backend context and config.

Every model forbids unknown fields so a typo in a config or a task is an error that names the
field instead of a silently ignored setting.
"""

from __future__ import annotations

import json
import os
import re
import sys
import typing
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails
from pydantic_settings import EnvSettingsSource
from typing_extensions import Self

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


def parse_config_arg(value: str | None) -> dict[str, Any]:
    """A config given on a command line: inline JSON object, or a path to a JSON file.

    Raises ValueError with a message that says which of the two went wrong.
    """
    if not value:
        return {}
    text = value.strip()
    if not text.startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"{value!r} is neither a JSON object nor a file")
        text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    return data


class StrictModel(BaseModel):
    """Base for every kvcore model: unknown fields are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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

    .. versionchanged:: 0.2 ``segmented_host``, ``checksums``.
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


class BackendContext(StrictModel):
    """Facts about the engine a backend is opened for, passed to its constructor."""

    layout: CacheLayout | None = None
    rank: int = Field(default=0, ge=0)
    world_size: int = Field(default=1, ge=1)
    device_id: int = Field(default=0, ge=0)
    namespace: str = "default"
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


class _EnvironSource(EnvSettingsSource):
    """pydantic-settings' environment source, reading a given mapping instead of os.environ
    (so :meth:`EnvConfig.load` can be tested, and called with an engine's own environment)."""

    def __init__(self, model: type[BaseModel], prefix: str, environ: Mapping[str, str]) -> None:
        self._environ = environ
        # typed for BaseSettings, but the source only reads the model's fields and config, so
        # any pydantic model will do
        super().__init__(model, case_sensitive=False, env_prefix=prefix)  # type: ignore[arg-type]

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {name.lower(): value for name, value in self._environ.items()}


def _admits_bool(annotation: Any) -> bool:
    """Whether a field's type takes a bool (``bool``, ``Any``, a union or literal holding one)."""
    if annotation in (bool, Any, object) or annotation is None:
        return True
    if isinstance(annotation, str):  # an unresolved forward reference: do not judge it
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in args)
    return any(_admits_bool(a) for a in args if a is not type(None))


class EnvConfig(StrictModel):
    """A config whose fields operators can override with environment variables.

    Subclasses set ``env_prefix`` (e.g. ``"KVCORE_FILE_"``); :meth:`load` then applies
    ``KVCORE_FILE_ROOT=/data`` as ``root``. Values in the environment override the given config
    (an operator's knob beats a baked-in file). Variables are read by pydantic-settings'
    environment source, so they follow its conventions: names are matched case-insensitively,
    lists, dicts and models are JSON, scalars are coerced by the field's type (``true``,
    ``42``, ``64GiB`` for a size). An invalid value is an error that names the variable.
    """

    env_prefix: ClassVar[str] = ""

    @field_validator("*", mode="before")
    @classmethod
    def _strict_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """A number field takes numbers: ``True`` is not a size or a rate (Python's bool is an
        int), and a subnormal float (below 2.2e-308) means nothing as a setting.

        .. versionadded:: 0.3
        """
        field = cls.model_fields.get(info.field_name or "")
        if field is None or not isinstance(value, (bool, float)):
            return value
        if isinstance(value, bool) and not _admits_bool(field.annotation):
            raise ValueError("must be a number, not a boolean")
        if isinstance(value, float) and 0 < abs(value) < sys.float_info.min:
            raise ValueError(f"{value!r} is a subnormal number: too small to be a setting")
        return value

    #: names accepted from the environment besides the fields (moved into place by a
    #: validator), with whether their value is a plain string
    env_extra_fields: ClassVar[tuple[str, ...]] = ()
    env_extra_strings: ClassVar[frozenset[str]] = frozenset({"namespace", "weight_version"})

    @classmethod
    def env_overrides(cls, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The values set by ``<env_prefix><FIELD>`` variables, by field name.

        Raises ValidationError naming the variable when a list, dict or model field's value
        is not JSON.
        """
        environ = os.environ if environ is None else environ
        found: dict[str, Any] = {}
        if not cls.env_prefix:
            return found
        source = _EnvironSource(cls, cls.env_prefix, environ)
        bad: list[InitErrorDetails] = []
        for name, field in cls.model_fields.items():
            raw, key, complex_value = source.get_field_value(field, name)
            try:
                value = source.prepare_field_value(name, field, raw, complex_value)
            except ValueError as exc:  # a complex field whose value is not JSON
                variable = cls.env_variable(name)
                bad.append(
                    {
                        "type": "json_invalid",
                        "loc": (_env_loc(name, variable),),
                        "input": raw,
                        "ctx": {"error": str(exc)},
                    }
                )
                continue
            if value is not None:
                found[key] = value
        if bad:
            raise ValidationError.from_exception_data(cls.__name__, bad)
        # names that are not fields (a validator moves them into place): JSON unless a string
        for name in cls.env_extra_fields:
            raw = environ.get(cls.env_variable(name))
            if raw is None:
                continue
            if name in cls.env_extra_strings:
                found[name] = raw
            else:
                try:
                    found[name] = json.loads(raw)
                except json.JSONDecodeError:
                    found[name] = raw  # let pydantic coerce or report it
        return found

    @classmethod
    def env_variable(cls, name: str) -> str:
        """The variable that overrides field (or extra name) ``name``."""
        return f"{cls.env_prefix}{name.upper()}"

    @classmethod
    def env_variables_set(cls, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """``{name: variable}`` for the ``<env_prefix><NAME>`` variables present in ``environ``
        (subclasses that read other variables add theirs, so errors can name them)."""
        environ = os.environ if environ is None else environ
        if not cls.env_prefix:
            return {}
        present = {k.upper() for k in environ}
        names = (*cls.model_fields, *cls.env_extra_fields)
        return {n: cls.env_variable(n) for n in names if cls.env_variable(n) in present}

    @classmethod
    def load(
        cls,
        config: BaseModel | Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Self:
        """Validate ``config`` (a dict, a model or None) with environment overrides applied.

        :raises ValidationError: naming each invalid field, and for a value that came from the
            environment the variable that set it.
        """
        if isinstance(config, BaseModel):
            data = config.model_dump(exclude_unset=True)
        else:
            data = dict(config or {})
        data.update(cls.env_overrides(environ))
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            variables = cls.env_variables_set(environ)
            if not variables:
                raise
            raise _name_variables(cls.__name__, exc, variables) from None


def _env_loc(name: str, variable: str) -> str:
    return f"{name} (environment variable {variable})"


def _name_variables(
    title: str, exc: ValidationError, variables: Mapping[str, str]
) -> ValidationError:
    """``exc`` with each error caused by an environment value saying which variable set it."""
    details: list[InitErrorDetails] = []
    for err in exc.errors(include_url=False):
        loc = list(err["loc"])
        for i, part in enumerate(loc):
            if isinstance(part, str) and part in variables:
                loc[i] = _env_loc(part, variables[part])
                break
        detail: InitErrorDetails = {"type": err["type"], "loc": tuple(loc), "input": err["input"]}
        if "ctx" in err:
            detail["ctx"] = err["ctx"]
        try:  # a custom error type (ByteSize's) cannot be rebuilt: keep its message
            ValidationError.from_exception_data(title, [detail])
        except (KeyError, TypeError, ValueError):
            detail = {
                "type": "value_error",
                "loc": tuple(loc),
                "input": err["input"],
                "ctx": {"error": ValueError(err["msg"])},
            }
        details.append(detail)
    return ValidationError.from_exception_data(title, details)


#: The longest timeout anything in kvcore accepts: a week. Longer (or infinite) values would
#: overflow the deadline thread's waits; no cache operation is worth waiting longer.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def timeout_field(default: float | None, description: str) -> Any:
    """A timeout in seconds: positive, finite, at most :data:`MAX_TIMEOUT_S`."""
    return Field(
        default=default, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description=description
    )


def interval_field(default: float, description: str) -> Any:
    """A duration in seconds where 0 means "never" or "at once": finite, at most
    :data:`MAX_TIMEOUT_S`, like every timeout (a backend's config uses it for its own waits).

    .. versionadded:: 0.3
    """
    return Field(
        default=default, ge=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description=description
    )


class BackendConfig(EnvConfig):
    """Base of every backend's own config model (see :class:`EnvConfig` for ``env_prefix``)."""

    default_timeout_s: float = timeout_field(
        5.0, "deadline of a call whose request has none; the transfer manager's task default"
    )


class _TaskBase(StrictModel):
    task_id: str = Field(min_length=1)
    timeout_s: float | None = timeout_field(None, "None: the manager's default timeout")


class QueryTask(_TaskBase):
    """Count the stored leading run of ``keys`` (blocks ``start_block ..``) on this rank.

    A query moves no data, so it names no device blocks.

    .. versionadded:: 0.2 (0.1 queried with a :class:`ReadTask`; its ``device_block_ids`` are
       still accepted here, and ignored, for one release)
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


class _BlockTask(_TaskBase):
    """Blocks ``start_block .. start_block + len(keys)`` paired with device blocks.

    ``keys[i]`` is the chained hash of block ``start_block + i``, held in device block
    ``device_block_ids[i]``; ``token_ids`` is the full token path from the root (required by
    token-addressed backends).
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
    """Restore the stored leading run of ``keys`` into ``device_block_ids``."""


class WriteTask(_BlockTask):
    """Store the blocks held in ``device_block_ids`` under ``keys``.

    .. versionchanged:: 0.2 a sibling of :class:`ReadTask`, no longer its subclass.
    """


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
#:    delivered); it was reported as ``backend_error``
TaskOutcome = Literal[
    "complete",
    "miss",
    "backend_error",
    "invalid_result",
    "deadline",
    "corrupt",
    "rejected",
    "error",
]


class TaskResult(StrictModel):
    """Outcome of one task: what was done, how many bytes, how long each stage took.

    ``outcome`` says why the task ended: ``complete`` (everything asked for was done),
    ``miss`` (the backend answered fewer blocks, without reporting a failure: the data is not
    there or did not fit), ``backend_error`` (the backend raised or reported a failure),
    ``invalid_result`` (it broke the hook contract), ``deadline`` (answered at the deadline with
    what was done by then), ``corrupt`` (a block read differed from its digest: it and the
    blocks after it were not delivered), ``rejected`` (not run: queue full, caches cleared, closing) or
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
