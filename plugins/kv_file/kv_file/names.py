"""A snapshot of the index's names, so the first query after a restart is as fast as the rest.

Object files are named by a hash of the object's name; the name itself is only in each file's
header. Without this file a restarted store learns names as queries use them, hashing every
name once (~30 ms for 10,000 blocks). The snapshot maps digests back to names and is written
at close and by the background scan, atomically (temp file and rename).

It is a hint, never trusted for data: a name it gives is only believed for a digest that a
scan found on disk, and every read still compares the name in the file's header. A snapshot
that fails its checksum, is of another version or is missing is ignored. Format (raw bytes,
nothing executable)::

    magic "KVCN", version u16, reserved u16, count u32
    count x (digest 16 bytes little-endian, name_len u32, UTF-8 name)
    xxh3_128 of everything above
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

import xxhash

from kv_file.objio import write_then_rename

__all__ = ["load_names", "save_names"]

_HEAD = struct.Struct("<4sHHI")
_ENTRY = struct.Struct("<16sI")
_MAGIC = b"KVCN"
_VERSION = 1


def save_names(path: str, temp: str, names: Iterable[tuple[int, str]]) -> int:
    """Write ``(digest, name)`` pairs to ``path`` atomically; returns how many."""
    parts: list[bytes] = []
    for digest, name in names:
        raw = name.encode("utf-8", "surrogatepass")
        parts.append(_ENTRY.pack(digest.to_bytes(16, "little"), len(raw)))
        parts.append(raw)
    body = _HEAD.pack(_MAGIC, _VERSION, 0, len(parts) // 2) + b"".join(parts)
    data = body + xxhash.xxh3_128_digest(body)

    def fill(fd: int) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    write_then_rename(temp, path, fill)
    return len(parts) // 2


def load_names(path: str) -> dict[int, str]:
    """The snapshot's ``digest -> name`` map; empty when it is missing or not intact."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return {}
    if len(data) < _HEAD.size + 16 or xxhash.xxh3_128_digest(data[:-16]) != data[-16:]:
        return {}
    magic, version, _, count = _HEAD.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        return {}
    out: dict[int, str] = {}
    pos, end = _HEAD.size, len(data) - 16
    unpack, size, from_bytes = _ENTRY.unpack_from, _ENTRY.size, int.from_bytes
    try:
        for _ in range(count):
            digest, n = unpack(data, pos)
            pos += size
            out[from_bytes(digest, "little")] = data[pos : pos + n].decode("utf-8", "surrogatepass")
            pos += n
    except (struct.error, UnicodeDecodeError):
        return {}
    return out if pos == end else {}
