"""What a block says of itself (kvcore's block metadata), kept in a Mooncake store.

Mooncake objects are bare bytes, so a block written with metadata gets a small companion object
beside its first object (and beside every object whose key is a digest of its name: the listing
names those by their companions), the object's key plus :data:`META_SUFFIX`, holding::

    magic "KVM1" | name length (u16) | metadata length (u32) | name | metadata | xxh3-64

The object's full name is in it, so the companion is checked against the name it is read for
(a companion of another object, or a flipped bit, is no metadata at all), and a store key that
is a digest of its name (:mod:`kv_mooncake.store_keys`) can be named again when the store is
listed. Companions are written before their objects (a peer that sees an object sees its
metadata) and removed with them; a clear's regular expression covers them.

No key of an object ends with the suffix: plain keys carry no ``#``, and a digest key ends in
hex.
"""

from __future__ import annotations

import struct

import xxhash

__all__ = ["META_SUFFIX", "decode", "encode", "is_meta_key", "meta_key"]

META_SUFFIX = "#meta"
_MAGIC = b"KVM1"
_HEAD = struct.Struct("<4sHI")
_SUM = struct.Struct("<Q")


def meta_key(key: str) -> str:
    """The key of the companion holding the metadata of the object stored under ``key``."""
    return key + META_SUFFIX


def is_meta_key(key: str) -> bool:
    return key.endswith(META_SUFFIX)


def encode(name: str, meta: bytes) -> bytes:
    """The companion of object ``name`` written with ``meta``."""
    raw = name.encode("utf-8", "surrogatepass")
    body = _HEAD.pack(_MAGIC, len(raw), len(meta)) + raw + meta
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode(blob: bytes) -> tuple[str, bytes] | None:
    """``(name, metadata)`` of a companion, or None when it does not verify (truncated,
    another format, a flipped bit)."""
    if len(blob) < _HEAD.size + _SUM.size:
        return None
    magic, name_len, meta_len = _HEAD.unpack_from(blob)
    end = _HEAD.size + name_len + meta_len
    if magic != _MAGIC or len(blob) != end + _SUM.size:
        return None
    if _SUM.unpack_from(blob, end)[0] != xxhash.xxh3_64_intdigest(memoryview(blob)[:end]):
        return None
    name = blob[_HEAD.size : _HEAD.size + name_len].decode("utf-8", "surrogatepass")
    return name, bytes(blob[_HEAD.size + name_len : end])
