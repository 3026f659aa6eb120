"""Corrupting a stored object the way a failing store does, for tests of every caller.

:func:`flip_a_stored_bit` changes one bit of an object a backend holds through the backend's
own hooks, below kvcore's facade and its block digests, so any backend (memory, Mooncake, a
vendor's) can be corrupted the same way under any caller: the transfer manager, an engine
adapter, a tier stack. What a test then checks is that no engine receives those bytes and that
the backend's facade counted the read as corrupt (:func:`corrupt_reads`).

.. versionadded:: 0.3
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from kvcore.backend import Backend
from kvcore.integrity import DIGEST_PART, FOREIGN_SUFFIX
from kvcore.requests import BlockRequest, HostBuffers

__all__ = ["corrupt_reads", "data_objects", "flip_a_stored_bit"]


def _one_object(name: str, host: HostBuffers) -> BlockRequest:
    return BlockRequest(
        task_id="kvcore-testing/flip",
        block_keys=(),
        object_names=((name,),),
        parts=("object",),
        deadline=time.monotonic() + 30.0,
        host=host,
        num_blocks=1,
        part_nbytes=host.nbytes,
    )


def flip_a_stored_bit(backend: Backend, name: str, nbytes: int, *, at: int | None = None) -> None:
    """Flip bit 4 of byte ``at`` (default: the middle) of the stored object ``name`` (``nbytes``
    long), through the backend's hooks (not the facade: no digest is updated).

    :raises AssertionError: the object could not be read, or the changed bytes not stored.
    """
    buf = np.zeros(nbytes, dtype=np.uint8)
    host = HostBuffers(((buf.ctypes.data,),), (nbytes,))
    request = _one_object(name, host)
    hook = backend.hook
    assert int(hook.kvcore_read(request=request)) == 1, f"cannot read {name!r}"
    before = buf.copy()
    buf[nbytes // 2 if at is None else at] ^= 0x10
    if backend.implements("kvcore_remove"):  # stores that keep the first put of a name
        hook.kvcore_remove(request=request)
    assert int(hook.kvcore_write(request=request)) == 1, f"cannot store {name!r} again"
    check = np.zeros(nbytes, dtype=np.uint8)
    again = _one_object(name, HostBuffers(((check.ctypes.data,),), (nbytes,)))
    assert int(hook.kvcore_read(request=again)) == 1, f"{name!r} is gone after the flip"
    assert not np.array_equal(check, before), f"{name!r} did not change"


def data_objects(names: Iterable[str]) -> list[str]:
    """The names among ``names`` that hold data, not block digests (e.g. from the ``stored``
    events of a backend: the facade's own name only data, a backend that reports its own
    changes names both)."""
    return [n for n in names if not n.endswith(FOREIGN_SUFFIX) and f"/{DIGEST_PART}/" not in n]


def corrupt_reads(backend: Backend) -> int:
    """Blocks the backend's facade refused because their bytes differed from their digests."""
    return int(backend.stats().get("corrupt_blocks.read", 0))
