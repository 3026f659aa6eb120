"""LMCache's keys as kvcore names, and back.

An LMCache ``ObjectKey`` (MP mode) is a chunk hash, a model name, a ``kv_rank`` (a bitmap of
world size, global rank, local world size and local rank), an object group and a
``cache_salt`` (the tenant). Every field is in the kvcore block key, so two keys that differ
in any of them never name the same object::

    {chunk hash, hex},{kv_rank, hex},{object group, hex},{model name, %-quoted}[,{salt id}]

The salt is a secret (:mod:`kvcore.tenants`): the key holds its id, the first 128 bits of its
SHA-256 in hex (:func:`salt_id`), never the salt, so no object name, header, journal or event
shows it. The quoted field never holds a ``,`` (quoting escapes it), so the key decodes back
to every field but the salt (:func:`key_fields`); the salt comes back from a
:class:`SaltBook` of the salts this process has seen (a listing and events need the whole
``ObjectKey``). The rank and world size kvcore puts in the object's name are the
``kv_rank``'s global rank and world size (for the store's events and tools); the whole
``kv_rank`` stays in the key, so nothing depends on that decoding.

Importing this module imports neither LMCache nor torch: keys are duck-typed.
"""

from __future__ import annotations

import functools
import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple, Protocol
from urllib.parse import quote, unquote

__all__ = [
    "KeyFields",
    "LMCacheKey",
    "SaltBook",
    "block_key",
    "key_fields",
    "salt_id",
    "slice_of",
]

_SEP = ","
#: a salt's id in a key: 128 bits of its SHA-256, hex (no two salts a store meets share one)
_SALT_ID = re.compile(r"[0-9a-f]{32}")


class LMCacheKey(Protocol):
    """What an LMCache ``ObjectKey`` has (the adapter reads nothing else)."""

    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int
    cache_salt: str


class KeyFields(NamedTuple):
    """The fields of an ``ObjectKey`` decoded from a block key: its salt as its id ("" for
    none; :meth:`SaltBook.salt_of` gives the salt back where this process has seen it)."""

    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int
    salt_id: str


def _quoted(text: str) -> str:
    return quote(text, safe="")


def salt_id(salt: str) -> str:
    """What a key holds of ``salt`` ("" for no salt): 128 bits of its SHA-256, hex."""
    if not salt:
        return ""
    return _salt_digest(salt)


@functools.lru_cache(maxsize=1 << 16)
def _salt_digest(salt: str) -> str:
    # memoised: every key of every batch names its salt, and a server sees few salts (one a
    # tenant); 0.13 us a lookup against 1.2 us a SHA-256 here. Like the SaltBook, it holds
    # salts in this process's memory only, as many as the SaltBook at most.
    return hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def block_key(key: LMCacheKey) -> str:
    """The kvcore block key of an LMCache ``ObjectKey`` (every field; the salt as its id)."""
    text = (
        f"{key.chunk_hash.hex()}{_SEP}{key.kv_rank:x}{_SEP}{key.object_group_id:x}"
        f"{_SEP}{_quoted(key.model_name)}"
    )
    if key.cache_salt:
        text += _SEP + salt_id(key.cache_salt)
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
    salt = fields[4] if len(fields) == 5 else ""
    if len(fields) == 5 and not _SALT_ID.fullmatch(salt):
        return None  # not a salt's id (an empty salt is written as no salt)
    return KeyFields(chunk_hash, unquote(fields[3]), kv_rank, group, salt)


class SaltBook:
    """The salts this process has seen, by their ids (:func:`salt_id`): what turns a key
    decoded from a name back into the ``ObjectKey`` it was made from; and the store's keys
    whose salt has not come yet, kept until it does. Held in memory only, never written.

    At most ``capacity`` salts (the least recently seen forgotten first: a salt per tenant is
    the use, and a flood of one-off salts must not grow it without bound) and ``waiting`` keys
    (past it, :meth:`wait` refuses). Thread-safe.
    """

    def __init__(self, capacity: int = 1 << 16, waiting: int = 1 << 20) -> None:
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._capacity = capacity
        self._waiting: dict[str, set[str]] = {}  # salt id -> block keys
        self._waiting_count = 0
        self._waiting_max = waiting
        self._lock = threading.Lock()

    def learn(self, salts: Iterable[str]) -> bool:
        """Remember ``salts``; True when one of them is some waiting key's
        (:meth:`resolved` then gives those keys)."""
        found = False
        with self._lock:
            ids = self._ids
            for salt in salts:
                if not salt:
                    continue
                sid = salt_id(salt)
                if sid in ids:
                    ids.move_to_end(sid)
                    continue
                ids[sid] = salt
                found = found or sid in self._waiting
                if len(ids) > self._capacity:
                    ids.popitem(last=False)
        return found

    def salt_of(self, sid: str) -> str | None:
        """The salt whose id is ``sid`` ("" for ""), or None where this process has not seen
        it."""
        if not sid:
            return ""
        with self._lock:
            return self._ids.get(sid)

    def wait(self, text: str) -> bool | None:
        """Keep ``text`` (a block key whose salt is unknown here) until its salt is learnt:
        True if it waits now, None if it was waiting already, False if it is no such key or
        too many already wait."""
        fields = key_fields(text)
        if fields is None or not fields.salt_id:
            return False
        with self._lock:
            waiting = self._waiting.get(fields.salt_id)
            if waiting is not None and text in waiting:
                return None
            if self._waiting_count >= self._waiting_max:
                return False
            self._waiting.setdefault(fields.salt_id, set()).add(text)
            self._waiting_count += 1
            return True

    def resolved(self) -> list[str]:
        """The waiting block keys whose salts are now known (no longer waiting)."""
        with self._lock:
            known = [sid for sid in self._waiting if sid in self._ids]
            texts = [t for sid in known for t in self._waiting.pop(sid)]
            self._waiting_count -= len(texts)
        return texts


def slice_of(kv_rank: int) -> tuple[int, int]:
    """``(rank, world_size)`` kvcore names the object with: the ``kv_rank``'s global rank and
    world size (LMCache's ``ObjectKey.ComputeKVRank`` packs them in bits 16-23 and 24-31), or
    rank 0 of 1 for a ``kv_rank`` that does not hold a valid pair."""
    world = (kv_rank >> 24) & 0xFF
    rank = (kv_rank >> 16) & 0xFF
    if world >= 1 and rank < world:
        return rank, world
    return 0, 1
