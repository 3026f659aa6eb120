"""FastDeploy's object names, as its cache transfer manager builds them.

``cache_transfer_manager.py`` (PaddlePaddle/FastDeploy@1af00818db85f4e844327e9ba5ccfacff1afe9bf,
lines 773-780 and 1003-1010) names the objects of block ``hash`` on tensor-parallel rank
``rank`` ``prefix{key_prefix}_{hash}_{rank}_key`` and ``..._value``, plus ``..._key_scale`` and
``..._value_scale`` for block-wise fp8 caches, where ``key_prefix`` is "" or the RL weight
version read from the model's ``version.yaml`` (e.g. ``RL-STEP12``). The adapter stores under
these names exactly, so data written by FastDeploy's own stores and by kvcore interoperate.
Names are data: nothing here parses them back into paths.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PART_SUFFIXES", "fastdeploy_names", "part_of"]

#: kvcore part -> the suffix FastDeploy gives its object name, in FastDeploy's key-list order
PART_SUFFIXES = {"k": "_key", "v": "_value", "k_scale": "_key_scale", "v_scale": "_value_scale"}


def fastdeploy_names(
    block_hashes: Sequence[str], rank: int, *, key_prefix: str = "", scales: bool = False
) -> dict[str, list[str]]:
    """Per part, the names FastDeploy uses for ``block_hashes`` on ``rank`` (K, V[, scales])."""
    parts = ("k", "v", "k_scale", "v_scale") if scales else ("k", "v")
    return {
        part: [f"prefix{key_prefix}_{h}_{rank}{PART_SUFFIXES[part]}" for h in block_hashes]
        for part in parts
    }


def part_of(name: str) -> str:
    """The kvcore part a FastDeploy object name stands for ("k" when it has no known suffix)."""
    # the scale suffixes end like no other, so test them first
    for part in ("k_scale", "v_scale", "v", "k"):
        if name.endswith(PART_SUFFIXES[part]):
            return part
    return "k"
