"""Turn a :class:`kvcore.BlockRequest` into the token arguments of an SDK call.

A request covers blocks ``start_block .. start_block + num_blocks``; ``token_ids`` is the whole
path from the root and may run past the request (or end inside it). The SDK identifies a block
by all tokens up to its end, so each call gets the tokens through the last covered block and
never more: trailing tokens would let the SDK act on blocks the caller did not ask about.

The core hands hooks well-formed requests (one device block id per block, one pointer per
layer), so nothing here re-checks their shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore import BlockRequest


@dataclass(frozen=True, slots=True)
class TokenSpan:
    """The tokens for one request and how many of its blocks they fully cover."""

    token_ids: list[int]
    start_block: int
    num_blocks: int  # <= request.num_blocks: a block without all its tokens cannot be named
    block_token_size: int

    def through(self, num_blocks: int) -> list[int]:
        """Tokens that end at block ``start_block + num_blocks`` (a call on fewer blocks)."""
        return self.token_ids[: (self.start_block + num_blocks) * self.block_token_size]


def token_span(request: BlockRequest, block_token_size: int) -> TokenSpan:
    """The token prefix that covers ``request``'s blocks (none without token ids)."""
    tokens = request.token_ids if request.token_ids is not None else ()
    start = request.start_block
    full_blocks = len(tokens) // block_token_size
    covered = max(0, min(request.num_blocks, full_blocks - start))
    end = (start + covered) * block_token_size
    return TokenSpan(list(tokens[:end]), start, covered, block_token_size)


def clamp_count(value: object, limit: int) -> int | None:
    """An SDK block count limited to ``[0, limit]``; None when it is not an integer at all."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return max(0, min(value, limit))
