"""What a stored page says of itself: its token ids and its parent page, so that a router index
that hashes token ids itself (Dynamo's, llm-d's) can place the storage tier's pages.

SGLang 0.5.23's storage API hands a backend page keys, host slots and the keys of the pages
before them (``HiCacheStorageExtraInfo.prefix_keys``), not the tokens. The tokens are in the
storage operation SGLang's backup thread is running (``HiCacheController._page_backup``'s
``operation``: its ``token_ids`` and ``hash_value``, page by page), which is on the stack when
``batch_set_v1`` is called. :func:`backup_facts` reads them from there and believes a page's
tokens only when SGLang's own page hash of them (``get_hash_str`` over the parent's hash) is
the page's key: a page whose tokens cannot be checked so (another SGLang version's stack) gets
no facts and is published without tokens, never with a guess. Pages of a LoRA adapter's or a
``cache_salt``'s chain (SGLang seeds those chains with a namespace) get none either: tokens
alone would let a token-hashing router credit one tenant's or adapter's pages to another's
requests.

Facts travel with the page as kvcore block metadata (:func:`encode`), so any process attached
to a shared store announces another's pages with their tokens.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PageFacts", "backup_facts", "decode", "encode"]

_VERSION = 1
_HEAD = struct.Struct("<BHI")  # version, parent key bytes, tokens
#: caller frames searched for SGLang's storage operation
_FRAMES = 6


@dataclass(frozen=True, slots=True)
class PageFacts:
    tokens: tuple[int, ...]
    parent: str | None  # the parent page's key; None: the first page of its sequence


def encode(facts: PageFacts) -> bytes:
    parent = (facts.parent or "").encode()
    tokens = np.asarray(facts.tokens, dtype="<u4").tobytes()
    return _HEAD.pack(_VERSION, len(parent), len(facts.tokens)) + parent + tokens


def decode(blob: bytes | None) -> PageFacts | None:
    """The facts of ``blob``; None for none, another version or a malformed one."""
    if not blob or len(blob) < _HEAD.size:
        return None
    version, parent_len, n = _HEAD.unpack_from(blob)
    if version != _VERSION or len(blob) != _HEAD.size + parent_len + 4 * n:
        return None
    at = _HEAD.size + parent_len
    try:
        parent = blob[_HEAD.size : at].decode() or None
    except UnicodeDecodeError:
        return None
    tokens = np.frombuffer(blob, dtype="<u4", count=n, offset=at)
    return PageFacts(tuple(int(t) for t in tokens), parent)


def backup_facts(keys: Sequence[str], page_size: int) -> list[PageFacts | None]:
    """Each page's facts, from SGLang's backup operation on the caller's stack, checked
    against the page's key; None for a page that cannot be checked (or no operation)."""
    operation = _operation_on_stack()
    if operation is None:
        return [None] * len(keys)
    from sglang.srt.mem_cache.utils import get_hash_str

    tokens = operation.token_ids
    if getattr(tokens, "extra_key", None) is not None or getattr(tokens, "cache_salt", None):
        return [None] * len(keys)  # a namespaced chain: see the module's docstring
    if getattr(tokens, "is_bigram", False):
        return [None] * len(keys)  # pages of token pairs: not what events name by tokens
    tokens = getattr(tokens, "token_ids", tokens)  # SGLang's RadixKey holds them
    hashes = list(operation.hash_value)
    where = {key: i for i, key in enumerate(hashes)}
    out: list[PageFacts | None] = []
    for key in keys:
        i = where.get(key)
        page = None if i is None else list(tokens[i * page_size : (i + 1) * page_size])
        if page is None or len(page) != page_size:
            out.append(None)
            continue
        parent = hashes[i - 1] if i else _before(operation)
        if get_hash_str(page, parent) != key:
            out.append(None)
            continue
        out.append(PageFacts(tuple(int(t) for t in page), parent))
    return out


def _before(operation: Any) -> str | None:
    """The key of the page before an operation's first: the last of its prefix keys (None:
    the operation starts its sequence, or SGLang passed none, and then the check decides)."""
    prefix = getattr(operation, "prefix_keys", None)
    return prefix[-1] if prefix else None


def _operation_on_stack() -> Any:
    frame = sys._getframe(2)
    for _ in range(_FRAMES):
        if frame is None:
            return None
        candidate = frame.f_locals.get("operation")
        if (
            candidate is not None
            and isinstance(getattr(candidate, "hash_value", None), list)
            and getattr(candidate, "token_ids", None) is not None
        ):
            return candidate
        frame = frame.f_back
    return None
