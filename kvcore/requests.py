"""What a backend receives: a run of blocks, how they are named, and where their bytes are.

These are plain frozen dataclasses rather than pydantic models: the core builds them from
already-validated tasks on the hot path, and a backend only reads them. Buffers are raw
``(pointer, nbytes)`` regions so no backend ever needs Paddle.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from kvcore.blockmeta import MAX_BLOCK_META_BYTES, check_block_meta
from kvcore.schemas import CacheLayout

__all__ = [
    "MAX_BLOCK_META_BYTES",
    "BlockRequest",
    "DeviceBuffers",
    "FailureKind",
    "HostBuffers",
    "Outcome",
    "Presence",
    "check_block_meta",
    "leading_run",
    "merge_spans",
]


class FailureKind(StrEnum):
    """Why a count fell short because something failed (an :attr:`Outcome.kind`).

    One rule decides ``deadline``: a short answer that comes back at or after the request's
    deadline is a deadline, whatever else the backend said (the count is what was done in
    time); a backend may also say ``deadline`` itself, earlier, when it knows it cannot
    finish in time.

    .. versionadded:: 0.3 (kinds were plain strings; they still compare equal to them)
    """

    #: the backend raised, or reported a failure (``Outcome(n, failure=...)``)
    BACKEND_ERROR = "backend_error"
    #: the backend broke the hook contract (strict mode raises instead)
    INVALID_RESULT = "invalid_result"
    #: time ran out: what was done by the deadline
    DEADLINE = "deadline"
    #: bytes read differ from their digest (never delivered; see :mod:`kvcore.integrity`)
    CORRUPT = "corrupt"
    #: the backend does not implement what was asked (a clear of its namespace, or of one
    #: tenant, where it has no such hook)
    UNSUPPORTED = "unsupported"
    #: a clear of a tenant the store does not know: its settings do not name it and it holds
    #: no object of it (``kvcore_clear_tenant``); nothing was wrong, and nothing was removed
    UNKNOWN_TENANT = "unknown_tenant"


class Outcome(int):
    """A block count that may also say why it fell short: a failure, not an absence.

    Hooks return plain ints; a backend that knows its short count is a failure (a full disk, a
    refused connection, a checksum mismatch) rather than data that is simply not there returns
    ``Outcome(n, failure="disk full")`` instead of raising. kvcore's facade returns an Outcome
    from every data call: ``failure`` is None for a clean answer, else a short reason (the
    backend's, or kvcore's: an exception, an invalid result, a missed deadline). It compares,
    adds and formats as the int it is.

    .. versionadded:: 0.2
    .. versionchanged:: 0.3 ``kind`` is a :class:`FailureKind` (a string naming one is
       accepted); a failure without a kind is ``backend_error``; ``refused`` (a write's
       blocks the store's admission policy did not take, :meth:`kvcore.Backend.write`)
    """

    failure: str | None
    #: what kind of failure (None for a clean answer); see :class:`FailureKind`
    kind: FailureKind | None
    #: blocks after the count that the store's admission policy refused (a write asked with
    #: ``admit=True``): not written, and not a failure
    refused: int

    def __new__(
        cls,
        count: int,
        failure: str | None = None,
        kind: FailureKind | str | None = None,
        *,
        refused: int = 0,
    ) -> Outcome:
        obj = super().__new__(cls, count)
        obj.failure = failure
        obj.refused = refused
        if kind is None:
            obj.kind = None if failure is None else FailureKind.BACKEND_ERROR
        else:
            try:
                obj.kind = FailureKind(kind)
            except ValueError:
                known = [k.value for k in FailureKind]
                raise ValueError(f"Outcome kind {kind!r} is not one of {known}") from None
        return obj

    def __repr__(self) -> str:
        n = int(self)
        return (
            f"Outcome({n})" if self.failure is None else f"Outcome({n}, failure={self.failure!r})"
        )


@dataclass(frozen=True, slots=True)
class Presence:
    """Which blocks of a request are stored, each on its own (:meth:`kvcore.Backend.contains`).

    ``found[i]`` is True when block ``i`` could be read now. ``failure`` and ``kind`` are as
    for :class:`Outcome`: set when something failed (the blocks it left unknown are False),
    None when the answer is clean.

    .. versionadded:: 0.3
    """

    found: tuple[bool, ...]
    failure: str | None = None
    kind: FailureKind | None = None

    @property
    def count(self) -> int:
        """How many blocks are stored."""
        return sum(self.found)


@dataclass(frozen=True, slots=True)
class HostBuffers:
    """Host memory for a run of blocks: block ``i``'s part ``j`` is ``nbytes[j]`` bytes.

    Two shapes, told apart by :attr:`contiguous`:

    - contiguous (staging): the object is one region at ``ptrs[i][j]``, laid out
      ``[layer, *block]`` as it is stored;
    - segmented (``layer_ptrs`` set, ``ptrs`` empty): the object's bytes are the engine's own
      cache blocks, one segment per layer: layer ``l``'s segment is ``segment_nbytes[j]`` bytes
      at ``layer_ptrs[j][l] + block_ids[i] * segment_nbytes[j]``, in layer order. kvcore sends
      these only to backends that declare ``Capabilities(segmented_host=True)``, which read and
      write them with :meth:`segments` or :meth:`views` (``preadv``/``pwritev`` take them as
      they are): no staging copy at all for engines whose cache lives in host memory.

    The memory belongs to the caller and stays valid until the hook returns. A read hook
    writes into it; a write hook must finish reading it before returning.

    .. versionchanged:: 0.2 the segmented shape (``layer_ptrs``, ``block_ids``,
       ``segment_nbytes``) and :meth:`segments` / :meth:`views`.
    """

    ptrs: tuple[tuple[int, ...], ...]
    nbytes: tuple[int, ...]
    layer_ptrs: tuple[tuple[int, ...], ...] | None = None
    block_ids: tuple[int, ...] = ()
    segment_nbytes: tuple[int, ...] = ()
    #: optional views of each whole layer (per part), so :meth:`views` slices instead of
    #: building a view per segment; the owner of the layers builds them once
    layer_views: tuple[tuple[memoryview, ...], ...] | None = field(
        default=None, compare=False, repr=False
    )

    @property
    def contiguous(self) -> bool:
        """True when each object is one region (``ptrs``); False for per-layer segments."""
        return self.layer_ptrs is None

    @property
    def num_blocks(self) -> int:
        return len(self.ptrs) if self.layer_ptrs is None else len(self.block_ids)

    def segments(self, block: int, part: int) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each piece of one object, in order (one piece if contiguous)."""
        if self.layer_ptrs is None:
            return [(self.ptrs[block][part], self.nbytes[part])]
        size = self.segment_nbytes[part]
        offset = self.block_ids[block] * size
        return [(base + offset, size) for base in self.layer_ptrs[part]]

    def views(self, block: int, part: int) -> list[memoryview]:
        """Writable views of one object's pieces, for ``os.preadv`` / ``os.pwritev``."""
        if self.layer_views is not None:
            size = self.segment_nbytes[part]
            lo = self.block_ids[block] * size
            return [layer[lo : lo + size] for layer in self.layer_views[part]]
        return [_view(ptr, n) for ptr, n in self.segments(block, part)]

    def memoryview(self, block: int, part: int) -> memoryview:
        """A writable view of one contiguous object's bytes (``readinto``/``write``, no copy)."""
        if self.layer_ptrs is not None:
            raise ValueError("segmented host buffers have no single view: use views()")
        return _view(self.ptrs[block][part], self.nbytes[part])

    def iovecs(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Every object's pieces as ``(address, nbytes)`` rows in ``[block][part]`` order (one
        row per piece: per layer when segmented), and where each object's rows start: object
        ``k``'s are rows ``starts[k] .. starts[k + 1]``. What :func:`kvcore.fileio.read_batch`
        and :func:`~kvcore.fileio.write_batch` take: one array for a whole batch, built
        without a Python step per object.

        .. versionadded:: 0.3
        """
        blocks = self.num_blocks
        if self.layer_ptrs is None:
            parts = len(self.nbytes)
            rows = np.empty((blocks * parts, 2), dtype=np.int64)
            rows[:, 0] = np.asarray(self.ptrs, dtype=np.uint64).reshape(-1).view(np.int64)
            rows[:, 1] = np.tile(np.asarray(self.nbytes, dtype=np.int64), blocks)
            return rows, np.arange(blocks * parts + 1, dtype=np.int64)
        offsets = np.asarray(self.block_ids, dtype=np.int64)
        per_part = []  # each part's rows: [block][layer] of (address, nbytes)
        for bases, size in zip(self.layer_ptrs, self.segment_nbytes, strict=True):
            part = np.empty((blocks, len(bases), 2), dtype=np.int64)
            base = np.asarray(bases, dtype=np.uint64).view(np.int64)
            part[:, :, 0] = base[None, :] + (offsets * size)[:, None]
            part[:, :, 1] = size
            per_part.append(part)
        rows = np.concatenate(per_part, axis=1).reshape(-1, 2)
        counts = np.tile([len(bases) for bases in self.layer_ptrs], blocks)
        starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        return rows, starts

    def flat(self) -> tuple[list[int], list[int]]:
        """Pointers and sizes in ``[block][part]`` order, as batch client APIs take them
        (contiguous buffers only)."""
        if self.layer_ptrs is not None:
            raise ValueError("segmented host buffers have no flat form: use segments()")
        ptrs = [p for block in self.ptrs for p in block]
        return ptrs, list(self.nbytes) * len(self.ptrs)

    def slice(self, lo: int, hi: int) -> HostBuffers:
        """The buffers of blocks ``lo .. hi - 1``."""
        if self.layer_ptrs is None:
            return HostBuffers(self.ptrs[lo:hi], self.nbytes)
        return replace(self, block_ids=self.block_ids[lo:hi])


def _view(ptr: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


@dataclass(frozen=True, slots=True)
class DeviceBuffers:
    """The engine's cache tensors, for backends that copy blocks themselves (``io="device"``).

    ``k_ptrs[l]`` / ``v_ptrs[l]`` point at layer ``layer_ids[l]``'s tensor, whose first
    dimension is the blocks (``layout.kv_layer_block_bytes`` bytes each); scale pointers are
    empty unless the layout has scales. ``block_ids[i]`` is the device block that holds block
    ``start_block + i``.
    """

    layout: CacheLayout
    layer_ids: tuple[int, ...]
    k_ptrs: tuple[int, ...]
    v_ptrs: tuple[int, ...]
    block_ids: tuple[int, ...]
    device_id: int = 0
    k_scale_ptrs: tuple[int, ...] = ()
    v_scale_ptrs: tuple[int, ...] = ()

    def slice(self, lo: int, hi: int) -> DeviceBuffers:
        return replace(self, block_ids=self.block_ids[lo:hi])


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """One call's worth of blocks: ``start_block .. start_block + num_blocks``.

    - ``block_keys[i]``: chained prefix hash of block ``start_block + i`` (empty for requests
      that carry tokens only, such as a token index's flush).
    - ``object_names[i][j]``: the name under which part ``parts[j]`` of that block is stored on
      this rank (key-addressed backends use these and nothing else).
    - ``token_ids``: the full token path from the root (token-addressed backends); may be None
      for key-addressed backends.
    - ``deadline``: a :func:`time.monotonic` instant; return what finished by then.
    - ``host`` / ``device``: the buffers for ``read``/``write``, per the backend's ``io``.
    - ``num_blocks``: how many blocks: ``len(block_keys)``, or given for a request that carries
      tokens only.
    - ``part_nbytes``: the size of each part's object when the request names parts of its own
      (not the layout's); the host buffers are checked against it.
    - ``block_meta``: on writes, what each block says of itself (``block_meta[i]``: at most
      :data:`MAX_BLOCK_META_BYTES` opaque bytes, the engine adapter's own encoding: its block
      hash, parent hash, token ids), stored with the block's objects by backends that declare
      ``Capabilities(block_meta=True)`` and returned by ``kvcore_describe`` to any process, so
      another engine sharing the store can announce the block without its payload. None: no
      metadata.
    - ``tenant``: whose request it is (:mod:`kvcore.tenants`: an operator's tenant name, never
      a salt), for figures per tenant and a store's shares; None: the request names none.
    - ``caller_idle``: the caller waits for this call with nothing of its own computing
      meanwhile (a synchronous load, made before the engine's step computes; a load-or-recompute
      probe made between steps). A backend whose client waits for a transfer by polling may
      then poll from a thread at the lowest CPU priority, which leaves the cores to the threads
      moving the bytes (Mooncake's client polls so). False (the default): assume the engine
      computes meanwhile; a lowest-priority thread would then wait for a core as long as the
      compute runs. Only a hint: a backend may ignore it, and one written before it does.

    What kvcore promises a hook (checked once, where the request enters the core): ``host`` is
    set on reads and writes of ``io="host"`` backends and ``device`` on those of ``io="device"``
    ones; ``object_names`` has ``num_blocks`` rows of ``len(parts)`` names (none when the
    request carries tokens only); host buffers hold ``num_blocks`` objects per part, each of
    ``layout.part_bytes(part)`` bytes when the context has a layout; token-addressed backends get
    ``token_ids`` covering every block of the request. Backends need not check any of it.

    .. versionchanged:: 0.2 ``num_blocks`` is a field (token-only requests carry no fake keys);
       ``part_nbytes``; :meth:`slice`.
    .. versionchanged:: 0.3 ``block_meta``, ``tenant``, ``caller_idle``.
    """

    task_id: str
    block_keys: tuple[str, ...]
    object_names: Sequence[tuple[str, ...]]
    parts: tuple[str, ...]
    deadline: float
    start_block: int = 0
    token_ids: Sequence[int] | None = None
    host: HostBuffers | None = None
    device: DeviceBuffers | None = None
    num_blocks: int = -1
    part_nbytes: tuple[int, ...] | None = None
    block_meta: tuple[bytes, ...] | None = None
    tenant: str | None = None
    caller_idle: bool = False

    def __post_init__(self) -> None:
        # keys, when present, decide (so dataclasses.replace(request, block_keys=...) stays
        # consistent); only a token-only request states its block count
        if self.block_keys or self.num_blocks < 0:
            object.__setattr__(self, "num_blocks", len(self.block_keys))

    def time_left(self) -> float:
        """Seconds until the deadline (negative once it has passed)."""
        return self.deadline - time.monotonic()

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def slice(
        self,
        lo: int,
        hi: int,
        *,
        host: HostBuffers | None = None,
        device: DeviceBuffers | None = None,
    ) -> BlockRequest:
        """Blocks ``lo .. hi - 1`` of this request (names reused, not rebuilt), with the
        given buffers (the span's own, already sliced by the caller)."""
        return BlockRequest(
            task_id=self.task_id,
            block_keys=self.block_keys[lo:hi],
            object_names=self.object_names[lo:hi],
            parts=self.parts,
            deadline=self.deadline,
            start_block=self.start_block + lo,
            token_ids=self.token_ids,
            host=host,
            device=device,
            num_blocks=hi - lo,
            part_nbytes=self.part_nbytes,
            block_meta=None if self.block_meta is None else self.block_meta[lo:hi],
            tenant=self.tenant,
            caller_idle=self.caller_idle,
        )

    def with_buffers(
        self, *, host: HostBuffers | None = None, device: DeviceBuffers | None = None
    ) -> BlockRequest:
        return replace(self, host=host, device=device)


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of ``(start, end)`` spans as sorted, disjoint spans (touching ones joined)."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def leading_run(ok: Sequence[bool] | Sequence[int], parts: int = 1) -> int:
    """Number of leading blocks whose ``parts`` consecutive entries are all ``> 0``.

    ``ok`` is flat in ``[block][part]`` order: booleans, or counts/codes where a positive
    value means success (bytes read, ``1`` for exists) and zero or negative means failure. A
    prefix cache can only use a contiguous run from the start, so a later success after a
    failure does not count.
    """
    n = len(ok) // parts
    for i in range(n):
        for j in range(parts):
            if not ok[i * parts + j] > 0:
                return i
    return n
