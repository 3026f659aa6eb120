"""What a backend receives: a run of blocks, how they are named, and where their bytes are.

These are plain frozen dataclasses rather than pydantic models: the core builds them from
already-validated tasks on the hot path, and a backend only reads them. Buffers are raw
``(pointer, nbytes)`` regions so no backend ever needs Paddle.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvcore.schemas import CacheLayout

__all__ = ["BlockRequest", "DeviceBuffers", "HostBuffers", "Outcome", "leading_run"]


class Outcome(int):
    """A block count that may also say why it fell short: a failure, not an absence.

    Hooks return plain ints; a backend that knows its short count is a failure (a full disk, a
    refused connection, a checksum mismatch) rather than data that is simply not there returns
    ``Outcome(n, failure="disk full")`` instead of raising. kvcore's facade returns an Outcome
    from every data call: ``failure`` is None for a clean answer, else a short reason (the
    backend's, or kvcore's: an exception, an invalid result, a missed deadline). It compares,
    adds and formats as the int it is.

    .. versionadded:: 0.2
    """

    failure: str | None

    def __new__(cls, count: int, failure: str | None = None) -> Outcome:
        obj = super().__new__(cls, count)
        obj.failure = failure
        return obj

    def __repr__(self) -> str:
        n = int(self)
        return (
            f"Outcome({n})" if self.failure is None else f"Outcome({n}, failure={self.failure!r})"
        )


@dataclass(frozen=True, slots=True)
class HostBuffers:
    """Host staging memory for a run of blocks: block ``i``'s part ``j`` is ``nbytes[j]`` bytes
    at ``ptrs[i][j]`` (staging layout ``[layer, head, block_size, head_dim]``).

    The memory belongs to the caller and stays valid until the hook returns. A read hook
    writes into it; a write hook must finish reading it before returning.
    """

    ptrs: tuple[tuple[int, ...], ...]
    nbytes: tuple[int, ...]

    def memoryview(self, block: int, part: int) -> memoryview:
        """A writable view of one object's bytes (for ``readinto``/``write`` without a copy)."""
        n = self.nbytes[part]
        return memoryview((ctypes.c_char * n).from_address(self.ptrs[block][part])).cast("B")

    def flat(self) -> tuple[list[int], list[int]]:
        """Pointers and sizes in ``[block][part]`` order, as batch client APIs take them."""
        ptrs = [p for block in self.ptrs for p in block]
        return ptrs, list(self.nbytes) * len(self.ptrs)


@dataclass(frozen=True, slots=True)
class DeviceBuffers:
    """The engine's cache tensors, for backends that copy blocks themselves (``io="device"``).

    ``k_ptrs[l]`` / ``v_ptrs[l]`` point at layer ``layer_ids[l]``'s tensor
    ``[num_blocks, heads, block_size, head_dim]``; scale pointers are empty unless the layout
    has scales. ``block_ids[i]`` is the device block that holds block ``start_block + i``.
    """

    layout: CacheLayout
    layer_ids: tuple[int, ...]
    k_ptrs: tuple[int, ...]
    v_ptrs: tuple[int, ...]
    block_ids: tuple[int, ...]
    device_id: int = 0
    k_scale_ptrs: tuple[int, ...] = ()
    v_scale_ptrs: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """One call's worth of blocks: ``start_block .. start_block + num_blocks``.

    - ``block_keys[i]``: chained prefix hash of block ``start_block + i``.
    - ``object_names[i][j]``: the name under which part ``parts[j]`` of that block is stored on
      this rank (key-addressed backends use these and nothing else).
    - ``token_ids``: the full token path from the root (token-addressed backends); may be None
      for key-addressed backends.
    - ``deadline``: a :func:`time.monotonic` instant; return what finished by then.
    - ``host`` / ``device``: the buffers for ``read``/``write``, per the backend's ``io``.
    """

    task_id: str
    block_keys: tuple[str, ...]
    object_names: tuple[tuple[str, ...], ...]
    parts: tuple[str, ...]
    deadline: float
    start_block: int = 0
    token_ids: Sequence[int] | None = None
    host: HostBuffers | None = None
    device: DeviceBuffers | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.block_keys)

    def time_left(self) -> float:
        """Seconds until the deadline (negative once it has passed)."""
        return self.deadline - time.monotonic()

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline


def leading_run(ok: Sequence[bool] | Sequence[int], parts: int = 1) -> int:
    """Number of leading blocks whose ``parts`` consecutive entries are all ``> 0``.

    ``ok`` is flat in ``[block][part]`` order: booleans, or counts/codes where a positive
    value means success (bytes read, ``1`` for exists) and zero or negative means failure. A prefix cache can only use a contiguous run
    from the start, so a later success after a failure does not count.
    """
    n = len(ok) // parts
    for i in range(n):
        for j in range(parts):
            if not ok[i * parts + j] > 0:
                return i
    return n
