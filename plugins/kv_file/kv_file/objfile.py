"""The on-disk format of one object: a fixed header, the object's name, then its raw bytes.

::

    magic    4s   b"KVCF"
    version  u16  1
    flags    u16  0
    name_len u32  bytes of the UTF-8 name that follows the header
    length   u64  payload bytes
    checksum 16s  xxh3_128 over name, length (little-endian u64) and payload
    (4 bytes padding, the name, zeros up to a 4 KiB boundary, then the payload)

The payload starts on a page boundary so the kernel copies whole pages between the page
cache and the (page-aligned) staging buffers: a misaligned copy measured ~20% slower.

The checksum covers the name and the length as well as the payload, so a flipped bit anywhere
but the magic and version makes the object a miss. Nothing in a file is ever executed or
unpickled: it is bytes in, bytes out.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

__all__ = [
    "DIGEST_AT",
    "HEADER",
    "MAGIC",
    "MAX_NAME_BYTES",
    "VERSION",
    "Header",
    "checksum",
    "header_size",
    "header_template",
    "pack_header",
]

MAGIC = b"KVCF"
VERSION = 1
HEADER = struct.Struct("<4sHHIQ16s4x")
#: where the checksum sits in the header (after magic, version, flags, name_len, length)
DIGEST_AT = 20
#: Names longer than this are refused (a write miss), so a header never needs a large read.
MAX_NAME_BYTES = 1 << 16
PAGE = 4096
_LEN = struct.Struct("<Q")


def encode_name(name: str) -> bytes:
    # surrogatepass: any Python str is a valid name; it must round-trip, not raise
    return name.encode("utf-8", "surrogatepass")


def header_size(name_len: int) -> int:
    """Bytes before the payload: header and name, rounded up to a page."""
    return -(-(HEADER.size + name_len) // PAGE) * PAGE


def checksum(name: bytes, payload: Sequence[memoryview | bytes]) -> bytes:
    """The checksum of an object whose payload is the concatenation of ``payload``'s pieces
    (one piece, or one per layer of an engine's own cache block: the same bytes, the same
    checksum)."""
    h = xxhash.xxh3_128()
    h.update(name)
    h.update(_LEN.pack(sum(len(piece) for piece in payload)))
    for piece in payload:
        h.update(piece)
    return h.digest()


def header_template(name: bytes, length: int) -> bytearray:
    """Header, name and padding of an object of ``length`` payload bytes, its checksum zero
    (at :data:`DIGEST_AT`, for the writer to fill)."""
    head = bytearray(header_size(len(name)))
    HEADER.pack_into(head, 0, MAGIC, VERSION, 0, len(name), length, bytes(16))
    head[HEADER.size : HEADER.size + len(name)] = name
    return head


def pack_header(name: bytes, payload: Sequence[memoryview | bytes]) -> bytes:
    """Header, name and padding, ready to be written in front of ``payload``'s pieces."""
    head = header_template(name, sum(len(piece) for piece in payload))
    head[DIGEST_AT : DIGEST_AT + 16] = checksum(name, payload)
    return bytes(head)


@dataclass(frozen=True, slots=True)
class Header:
    name_len: int
    length: int
    digest: bytes

    @property
    def size(self) -> int:
        """Bytes before the payload."""
        return header_size(self.name_len)

    @classmethod
    def parse(cls, raw: bytes | bytearray | memoryview) -> Header | None:
        """The header at the start of ``raw``; None when it is not one of ours."""
        if len(raw) < HEADER.size:
            return None
        magic, version, _flags, name_len, length, digest = HEADER.unpack_from(raw)
        if magic != MAGIC or version != VERSION or name_len > MAX_NAME_BYTES:
            return None
        return cls(name_len, length, digest)
