"""The on-disk format of one object: a fixed header, the object's name, then its raw bytes.

::

    magic    4s   b"KVCF"
    version  u16  1
    flags    u16  0, or 1 (FLAG_META) when the object carries its block's metadata
    name_len u32  bytes of the UTF-8 name that follows the header
    length   u64  payload bytes
    checksum 16s  xxh3_128 over name, length (little-endian u64) and payload
    meta_len u32  bytes of metadata (0: none)
    (the name; with metadata, its u64 xxh3_64 over name and metadata, then the metadata; zeros
    up to 8 bytes short of a 4 KiB boundary; the write's stamp, u64; then the payload)

The **write stamp** (the header page's last 8 bytes) is the same in every part of a block
written together: :func:`block_stamp` of the parts' checksums (see :mod:`kv_file.stamps`,
which makes and compares them). An object from before stamps has zeros there, or the last
bytes of its metadata (the same for every part of a block): the parts of such a block agree
with each other as before.

A block's metadata (``BlockRequest.block_meta``: what an engine's events say of the block)
lives in the header's page, in what was padding before it existed: an object's size is
still ``header_size(name_len) + length``, and a reader that predates it (its ``meta_len``
was padding it never read) reads the object as before. Metadata that does not fit in the
page beside the name is not stored (:func:`meta_fits`). It has its own digest, so it is
verified without reading the payload.

The payload starts on a page boundary so the kernel copies whole pages between the page
cache and the (page-aligned) staging buffers: a misaligned copy measured ~20% slower.

The checksum covers the name and the length as well as the payload, so a flipped bit anywhere
but the magic and version makes the object a miss. Nothing in a file is ever executed or
unpickled: it is bytes in, bytes out.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

__all__ = [
    "DIGEST_AT",
    "FLAG_META",
    "HEADER",
    "HEAD_COMPARE_MASK",
    "MAGIC",
    "MAX_NAME_BYTES",
    "VERSION",
    "Header",
    "block_stamp",
    "checksum",
    "head_fields",
    "header_size",
    "header_template",
    "meta_fits",
    "pack_header",
    "stamp_of",
]

MAGIC = b"KVCF"
VERSION = 1
HEADER = struct.Struct("<4sHHIQ16sI")
#: where the checksum sits in the header (after magic, version, flags, name_len, length)
DIGEST_AT = 20
#: the flag of an object that carries its block's metadata
FLAG_META = 1
_META_DIGEST = struct.Struct("<Q")
#: the write stamp, at the end of the header page(s)
_STAMP = struct.Struct("<Q")
#: Names longer than this are refused (a write miss), so a header never needs a large read.
MAX_NAME_BYTES = 1 << 16
PAGE = 4096
_LEN = struct.Struct("<Q")
_NO_DIGEST = bytes(16)
#: Which bytes of :func:`head_fields` (without metadata) a reader compares with the file's
#: head: magic, version, name length and payload length (1); not the flags, checksum and
#: metadata length (0), which depend on what the writer stored; the name after it, all of it.
HEAD_COMPARE_MASK = bytes([1] * 6 + [0] * 2 + [1] * 12 + [0] * 16 + [0] * 4)


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


def block_stamp(checksums: Sequence[bytes]) -> int:
    """The write stamp of a block whose parts (in part order) have these checksums."""
    return xxhash.xxh3_64_intdigest(b"".join(checksums))


def meta_fits(name_len: int, meta_len: int) -> bool:
    """Whether ``meta_len`` bytes of metadata fit in the header's page(s) beside a name of
    ``name_len`` bytes and the write stamp (the object's size does not depend on its
    metadata)."""
    return _meta_ends_by(name_len, meta_len, header_size(name_len) - _STAMP.size)


def _meta_ends_by(name_len: int, meta_len: int, end: int) -> bool:
    return HEADER.size + name_len + _META_DIGEST.size + meta_len <= end


def stamp_of(head: bytes | bytearray | memoryview) -> int:
    """The write stamp in ``head``, an object's header page(s) whole (see the module
    docstring)."""
    return int(_STAMP.unpack_from(head, len(head) - _STAMP.size)[0])


def _meta_digest(name: bytes, meta: bytes) -> bytes:
    return _META_DIGEST.pack(xxhash.xxh3_64_intdigest(name + meta))


@functools.lru_cache(maxsize=64)
def _plain_header(name_len: int, length: int) -> bytes:
    """The fixed header of an object without metadata: the same for every object of a request
    (names of one length, parts of one size), so packed once."""
    return HEADER.pack(MAGIC, VERSION, 0, name_len, length, _NO_DIGEST, 0)


def head_fields(name: bytes, length: int, meta: bytes | None = None) -> bytes:
    """What comes before the padding of an object of ``length`` payload bytes: header, name,
    metadata (when given and it fits), the checksum zero (at :data:`DIGEST_AT`, for the writer
    to fill). Under :data:`HEAD_COMPARE_MASK`, also what a reader must find there."""
    if meta is not None and not meta_fits(len(name), len(meta)):
        meta = None
    if meta is None:
        return _plain_header(len(name), length) + name
    fixed = HEADER.pack(MAGIC, VERSION, FLAG_META, len(name), length, _NO_DIGEST, len(meta))
    return b"".join((fixed, name, _meta_digest(name, meta), meta))


def header_template(
    name: bytes, length: int, meta: bytes | None = None, stamp: int = 0
) -> bytearray:
    """:func:`head_fields`, the padding and the write stamp up to the payload: the header
    page(s) as written."""
    head = bytearray(header_size(len(name)))
    fields = head_fields(name, length, meta)
    head[: len(fields)] = fields
    _STAMP.pack_into(head, len(head) - _STAMP.size, stamp)
    return head


def pack_header(
    name: bytes,
    payload: Sequence[memoryview | bytes],
    meta: bytes | None = None,
    stamp: int = 0,
    digest: bytes | None = None,
) -> bytes:
    """Header, name, metadata, padding and stamp, ready to be written in front of
    ``payload``'s pieces. ``digest``: the payload's :func:`checksum`, when known already."""
    head = header_template(name, sum(len(piece) for piece in payload), meta, stamp)
    head[DIGEST_AT : DIGEST_AT + 16] = digest if digest is not None else checksum(name, payload)
    return bytes(head)


@dataclass(frozen=True, slots=True)
class Header:
    name_len: int
    length: int
    digest: bytes
    meta_len: int = 0

    @property
    def size(self) -> int:
        """Bytes before the payload."""
        return header_size(self.name_len)

    @classmethod
    def parse(cls, raw: bytes | bytearray | memoryview) -> Header | None:
        """The header at the start of ``raw``; None when it is not one of ours."""
        if len(raw) < HEADER.size:
            return None
        magic, version, flags, name_len, length, digest, meta_len = HEADER.unpack_from(raw)
        if magic != MAGIC or version != VERSION or name_len > MAX_NAME_BYTES:
            return None
        # metadata written before stamps could reach the page's end: still read
        if not flags & FLAG_META or not _meta_ends_by(name_len, meta_len, header_size(name_len)):
            meta_len = 0
        return cls(name_len, length, digest, meta_len)

    def meta(self, head: bytes | bytearray | memoryview, name: bytes) -> bytes | None:
        """The metadata in ``head`` (the object's header page(s)) of an object named ``name``,
        verified; None when the object carries none, is another's, or it does not verify."""
        if not self.meta_len or self.name_len != len(name):
            return None
        at = HEADER.size + self.name_len
        end = at + _META_DIGEST.size + self.meta_len
        if len(head) < end or bytes(head[HEADER.size : at]) != name:
            return None
        meta = bytes(head[at + _META_DIGEST.size : end])
        return meta if head[at : at + _META_DIGEST.size] == _meta_digest(name, meta) else None
