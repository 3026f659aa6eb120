"""Map kvcore object names to Mooncake keys.

Names are data: a request may carry ``/``, NUL, newlines, ``..`` or 10 KB of text. Mooncake
rejects an empty key, its optional SSD offload may turn keys into file names, and every key
travels in each master RPC, so only short names made of plain characters pass unchanged;
anything else becomes ``#sha256:<hex>`` of its UTF-8 bytes. ``#`` never appears in a name
that passes, so an encoded key cannot collide with a plain one.
"""

from __future__ import annotations

import functools
import hashlib
import re

__all__ = ["MAX_PLAIN_KEY", "store_key"]

MAX_PLAIN_KEY = 200
_PLAIN = re.compile(r"[A-Za-z0-9_.:=+/-]+")
_HASHED_PREFIX = "#sha256:"


@functools.lru_cache(maxsize=16384)  # shared prefixes are looked up again and again
def store_key(name: str) -> str:
    """The Mooncake key for one object name (stable across processes and machines)."""
    if (
        len(name) <= MAX_PLAIN_KEY
        and _PLAIN.fullmatch(name)
        and ".." not in name
        and "//" not in name
        and not name.startswith(("/", "."))
    ):
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
    return _HASHED_PREFIX + digest
