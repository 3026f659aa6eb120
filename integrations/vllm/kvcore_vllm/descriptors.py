"""What a stored block says of itself: the fields of vLLM's ``BlockStored`` for that block,
written with it (kvcore's block metadata, ``BlockRequest.block_meta``) so that any engine
sharing the store can announce it, not only the one that computed it.

A descriptor is msgpack (no pickle: any process reads it) of
``[FORMAT, block_hash, parent_hash, token_ids, block_size, lora_id, lora_name, extra_keys]``,
exactly as the writing engine's own GPU events name the block: vLLM's hashes
(``maybe_convert_block_hash``), the block's token ids, its adapter and its extra keys
(``to_event_extra_keys``: LoRA name, multimodal items, ``cache_salt``, prompt-embeds digests).
A reader trusts a descriptor only for the key it was read under: its hash must be the one the
key was made from (:meth:`BlockDescriber.matches`), so a block is never announced under
another request's name.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvcore import MAX_BLOCK_META_BYTES

__all__ = ["FORMAT", "BlockDescriber", "BlockFacts", "decode", "encode"]

log = logging.getLogger("vllm.kvcore_vllm.descriptors")

#: the descriptor's layout; a reader refuses formats it does not know (counted, not guessed)
FORMAT = 1

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


@dataclass(slots=True)
class BlockFacts:
    """What vLLM's ``BlockStored`` says of one block (as its GPU events say it)."""

    block_hash: Any
    parent_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None


def encode(facts: BlockFacts) -> bytes:
    """The descriptor of ``facts``; ``b""`` (no descriptor) when it would exceed what a block
    may carry (a block of thousands of tokens)."""
    raw = _encoder.encode(
        [
            FORMAT,
            facts.block_hash,
            facts.parent_hash,
            facts.token_ids,
            facts.block_size,
            facts.lora_id,
            facts.lora_name,
            facts.extra_keys,
        ]
    )
    return raw if len(raw) <= MAX_BLOCK_META_BYTES else b""


def decode(raw: bytes) -> BlockFacts | None:
    """The facts in a descriptor; None for one of another format or shape."""
    try:
        fields = _decoder.decode(raw)
    except msgspec.DecodeError:
        return None
    if not isinstance(fields, list) or len(fields) != 8 or fields[0] != FORMAT:
        return None
    _, block_hash, parent, tokens, block_size, lora_id, lora_name, extra = fields
    if (
        not _is_hash(block_hash)
        or not (parent is None or _is_hash(parent))
        or not isinstance(tokens, list)
        or not all(type(t) is int for t in tokens)
        or type(block_size) is not int
        or not (lora_id is None or type(lora_id) is int)
        or not (lora_name is None or isinstance(lora_name, str))
        or not (extra is None or isinstance(extra, list))
    ):
        return None
    extra_keys = None if extra is None else [None if e is None else _tuple(e) for e in extra]
    return BlockFacts(block_hash, parent, tokens, block_size, lora_id, lora_name, extra_keys)


def _is_hash(value: object) -> bool:
    return type(value) is int or isinstance(value, bytes)


def _tuple(value: Any) -> Any:
    """msgpack arrays back to the tuples vLLM's extra keys are made of."""
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value


class BlockDescriber:
    """The facts of a request's blocks, as vLLM's own events give them, and the check that a
    descriptor read back belongs to the key it was read under."""

    def __init__(self, block_size: int, request_keys: Any) -> None:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._convert = maybe_convert_block_hash
        self._keys = request_keys
        self.block_size = block_size

    def block_hash(self, key: str) -> Any:
        """vLLM's (event) hash of the block a kvcore key names (the key is made from it)."""
        return self._convert(self._keys.block_hash(key))

    def describe(
        self, request: Any, keys: Sequence[str], first_block: int
    ) -> list[tuple[str, BlockFacts]]:
        """Blocks ``first_block ..`` of ``request`` (kvcore ``keys``): hash, parent hash,
        token ids, adapter, extra keys."""
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            to_event_extra_keys,
        )

        tokens = request.all_token_ids
        bs = self.block_size
        lora = getattr(request, "lora_request", None)
        parent = (
            self.block_hash(self._keys.keys(request, first_block - 1, first_block)[0])
            if first_block > 0
            else None
        )
        out = []
        for offset, key in enumerate(keys):
            i = first_block + offset
            block_hash = self.block_hash(key)
            extra, _ = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)
            facts = BlockFacts(
                block_hash=block_hash,
                parent_hash=parent,
                token_ids=list(tokens[i * bs : (i + 1) * bs]),
                block_size=bs,
                lora_id=lora.adapter_id if lora is not None else None,
                lora_name=lora.name if lora is not None else None,
                extra_keys=to_event_extra_keys([extra]),
            )
            out.append((key, facts))
            parent = block_hash
        return out

    def matches(self, key: str, facts: BlockFacts) -> bool:
        """Whether ``facts`` (read from the store under ``key``) are that block's: the hash
        the key was made from, this engine's block size, a full block of tokens."""
        raw = self._keys.block_hash(key)
        return (
            raw is not None
            and facts.block_size == self.block_size
            and len(facts.token_ids) == self.block_size
            and facts.block_hash == self._convert(raw)
        )
