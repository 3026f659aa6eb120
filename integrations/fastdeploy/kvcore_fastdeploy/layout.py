"""FastDeploy's cache description, as a :class:`kvcore.CacheLayout`.

The cache transfer manager gets ``--key_cache_shape num_blocks,heads,block_size,head_dim``,
``--num_layers``, ``--cache_dtype`` and the speculative config's extra layers; block-wise fp8
scales are tensors of Paddle's default dtype (cache_transfer_manager.py at 1af00818, lines
176-181 and 480-497). Its storage buffers hold one block of one part for all layers, laid out
``[layer, head, block_size, head_dim]`` (lines 392-399): exactly kvcore's object layout, so
``layout.part_bytes(part)`` is FastDeploy's ``cache_buffer_stride_bytes`` (K, V) or
``scale_buffer_stride_bytes`` (scales).
"""

from __future__ import annotations

from collections.abc import Sequence

import kvcore

__all__ = ["layout_from_fastdeploy"]

_SCALE_DTYPES = ("float32", "bfloat16", "float16")


def layout_from_fastdeploy(
    key_cache_shape: Sequence[int],
    num_layers: int,
    cache_dtype: str,
    *,
    num_extra_layers: int = 0,
    scale_dtype: str = "bfloat16",
) -> kvcore.CacheLayout:
    """The layout of one rank's cache; errors name the FastDeploy argument at fault."""
    shape = [int(s) for s in key_cache_shape]
    if len(shape) != 4:
        raise ValueError(
            f"key_cache_shape {list(key_cache_shape)} must be num_blocks,heads,block_size,head_dim"
        )
    if cache_dtype not in {d.value for d in kvcore.CacheDType}:
        raise ValueError(
            f"cache_dtype {cache_dtype!r} is not one of "
            f"{sorted(d.value for d in kvcore.CacheDType)}"
        )
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(
            f"scale_dtype {scale_dtype!r} (Paddle's default dtype) must be one of {_SCALE_DTYPES}"
        )
    num_blocks, heads, block_size, head_dim = shape
    return kvcore.CacheLayout(
        num_layers=num_layers,
        num_extra_layers=num_extra_layers,
        num_heads=heads,
        block_size=block_size,
        head_dim=head_dim,
        dtype=cache_dtype,
        scale_dtype=scale_dtype,
        num_blocks=num_blocks,
    )
