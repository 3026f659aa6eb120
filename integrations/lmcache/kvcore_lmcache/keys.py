"""LMCache's keys as kvcore names, and back.

An LMCache ``ObjectKey`` (MP mode) is a chunk hash, a model name, a ``kv_rank`` (a bitmap of
world size, global rank, local world size and local rank), an object group and a
``cache_salt`` (the tenant). Every field is in the kvcore block key, so two keys that differ
in any of them never name the same object::

    {chunk hash, hex},{kv_rank, hex},{object group, hex},{model name, %-quoted}[,{salt, %-quoted}]

The quoted fields never hold a ``,`` (quoting escapes it), so the key decodes back to the
``ObjectKey`` it was made from (:func:`object_key`, for listings). The rank and world size
kvcore puts in the object's name are the ``kv_rank``'s global rank and world size (for the
store's events and tools); the whole ``kv_rank`` stays in the key, so nothing depends on that
decoding.

Importing this module imports neither LMCache nor torch: keys are duck-typed.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol
from urllib.parse import quote, unquote

__all__ = ["KeyFields", "LMCacheKey", "block_key", "key_fields", "slice_of"]

_SEP = ","


class LMCacheKey(Protocol):
    """What an LMCache ``ObjectKey`` has (the adapter reads nothing else)."""

    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int
    cache_salt: str


class KeyFields(NamedTuple):
    """The fields of an ``ObjectKey`` decoded from a block key."""

    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int
    cache_salt: str


def _quoted(text: str) -> str:
    return quote(text, safe="")


def block_key(key: LMCacheKey) -> str:
    """The kvcore block key of an LMCache ``ObjectKey`` (every field, reversible)."""
    text = (
        f"{key.chunk_hash.hex()}{_SEP}{key.kv_rank:x}{_SEP}{key.object_group_id:x}"
        f"{_SEP}{_quoted(key.model_name)}"
    )
    if key.cache_salt:
        text += _SEP + _quoted(key.cache_salt)
    return text


def key_fields(text: str) -> KeyFields | None:
    """The fields :func:`block_key` encoded in ``text``; None for anything else."""
    fields = text.split(_SEP)
    if len(fields) not in (4, 5):
        return None
    try:
        chunk_hash = bytes.fromhex(fields[0])
        kv_rank = int(fields[1], 16)
        group = int(fields[2], 16)
    except ValueError:
        return None
    salt = unquote(fields[4]) if len(fields) == 5 else ""
    if len(fields) == 5 and not salt:
        return None  # an empty salt is written as no salt
    return KeyFields(chunk_hash, unquote(fields[3]), kv_rank, group, salt)


def slice_of(kv_rank: int) -> tuple[int, int]:
    """``(rank, world_size)`` kvcore names the object with: the ``kv_rank``'s global rank and
    world size (LMCache's ``ObjectKey.ComputeKVRank`` packs them in bits 16-23 and 24-31), or
    rank 0 of 1 for a ``kv_rank`` that does not hold a valid pair."""
    world = (kv_rank >> 24) & 0xFF
    rank = (kv_rank >> 16) & 0xFF
    if world >= 1 and rank < world:
        return rank, world
    return 0, 1
