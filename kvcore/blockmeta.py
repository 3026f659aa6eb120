"""What a block may say of itself (:attr:`kvcore.BlockRequest.block_meta`), and the one check of
it, used wherever it enters kvcore (a :class:`kvcore.WriteTask`, :meth:`kvcore.Backend.request`).

.. versionadded:: 0.3
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MAX_BLOCK_META_BYTES", "check_block_meta"]

#: the most bytes of metadata a block may carry: small enough for a backend to keep it beside
#: an object's name (kv_file: in the header's page)
MAX_BLOCK_META_BYTES = 2048


def check_block_meta(block_meta: Sequence[object], num_blocks: int) -> tuple[bytes, ...]:
    """``block_meta`` as kvcore accepts it: one ``bytes`` per block, none longer than
    :data:`MAX_BLOCK_META_BYTES`; a ValueError naming the entry otherwise."""
    if not isinstance(block_meta, list | tuple) or len(block_meta) != num_blocks:
        raise ValueError(f"block_meta must hold one bytes per block ({num_blocks} blocks)")
    out: list[bytes] = []
    for i, meta in enumerate(block_meta):
        if not isinstance(meta, bytes):
            raise ValueError(f"block_meta[{i}] is {type(meta).__name__}, not bytes")
        if len(meta) > MAX_BLOCK_META_BYTES:
            raise ValueError(
                f"block_meta[{i}] is {len(meta)} bytes; at most {MAX_BLOCK_META_BYTES} are stored"
            )
        out.append(meta)
    return tuple(out)
