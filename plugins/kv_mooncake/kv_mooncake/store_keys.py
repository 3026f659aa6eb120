"""Map kvcore object names to Mooncake keys, every key under its namespace's prefix.

Names are data: a request may carry ``/``, NUL, newlines, ``..`` or 10 KB of text. Mooncake
rejects an empty key, its optional SSD offload may turn keys into file names, and every key
travels in each master RPC, so only short names made of plain characters pass unchanged;
anything else becomes ``<prefix>#sha256:<hex>`` of its UTF-8 bytes. ``#`` never appears in a
name that passes, so an encoded key cannot collide with a plain one.

Every key of a namespace starts with that namespace's prefix (:func:`namespace_prefix`), and
no prefix starts another's, so ``clear`` removes one namespace with one anchored regular
expression (:func:`namespace_pattern`; Mooncake's client cannot list keys): ``<namespace>/``
for a namespace that is plain itself (a plain name of it starts so already), else
``#ns-<sha256 of the namespace>/``.
"""

from __future__ import annotations

import functools
import hashlib
import re

__all__ = ["MAX_PLAIN_KEY", "namespace_pattern", "namespace_prefix", "store_key", "store_key_as_is"]

MAX_PLAIN_KEY = 200
_PLAIN = re.compile(r"[A-Za-z0-9_.:=+/-]+")
_PLAIN_NAMESPACE = re.compile(r"[A-Za-z0-9_.:=+-]{1,64}")  # no "/": no prefix starts another
_HASHED = "#sha256:"


def _plain(name: str) -> bool:
    return (
        len(name) <= MAX_PLAIN_KEY
        and _PLAIN.fullmatch(name) is not None
        and ".." not in name
        and "//" not in name
        and not name.startswith(("/", "."))
    )


@functools.lru_cache(maxsize=256)
def namespace_prefix(namespace: str) -> str:
    """What every key of ``namespace`` starts with."""
    if _PLAIN_NAMESPACE.fullmatch(namespace) and _plain(f"{namespace}/x"):
        return f"{namespace}/"
    return f"#ns-{hashlib.sha256(namespace.encode('utf-8', 'surrogatepass')).hexdigest()}/"


def namespace_pattern(namespace: str) -> str:
    """A regular expression (ECMAScript, as Mooncake's master takes it) matching exactly the
    keys of ``namespace``."""
    escaped = "".join(c if c.isascii() and (c.isalnum() or c == "_") else f"\\{c}" for c in
                      namespace_prefix(namespace))  # fmt: skip
    return f"^{escaped}"


@functools.lru_cache(maxsize=16384)  # shared prefixes are looked up again and again
def store_key(name: str, namespace: str = "default") -> str:
    """The Mooncake key for object ``name`` of ``namespace`` (stable across processes and
    machines)."""
    prefix = namespace_prefix(namespace)
    if name.startswith(prefix) and _plain(name):
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{prefix}{_HASHED}{digest}"


@functools.lru_cache(maxsize=16384)
def store_key_as_is(name: str) -> str:
    """The Mooncake key for object ``name`` under ``key_scheme="as_is"``: the name itself when
    it is plain (so another client naming keys the same way finds the same objects), else
    ``#sha256:<hex>``."""
    if _plain(name):
        return name
    return _HASHED + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
