"""Turn a :class:`kvcore.BlockRequest` into the arguments of an SDK call.

A request covers blocks ``start_block .. start_block + num_blocks``; ``token_ids`` is the whole
path from the root and may run past the request (or end inside it). The SDK identifies a block
by all tokens up to its end, so each call gets the tokens through the last covered block and
never more: trailing tokens would let the SDK act on blocks the caller did not ask about.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_attentionstore.config import SdkSettings
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
    """The token prefix that covers ``request``'s blocks; raise if the request has no tokens."""
    tokens = request.token_ids
    if tokens is None:
        raise ValueError(
            f"request {request.task_id!r}: token_ids is required by the token-addressed "
            "'attentionstore' backend (the full token path from the root)"
        )
    start = request.start_block
    full_blocks = len(tokens) // block_token_size
    covered = max(0, min(request.num_blocks, full_blocks - start))
    end = (start + covered) * block_token_size
    return TokenSpan(list(tokens[:end]), start, covered, block_token_size)


@dataclass(frozen=True, slots=True)
class DeviceArgs:
    """Per-layer pointers and device block ids, as the SDK's read and write take them."""

    layer_ids: list[int]
    k_ptrs: list[int]
    v_ptrs: list[int]
    block_ids: list[int]


def device_args(request: BlockRequest, settings: SdkSettings) -> DeviceArgs:
    """Check the request's device buffers against what the SDK was opened with."""
    dev = request.device
    where = f"request {request.task_id!r}"
    if dev is None:
        raise ValueError(f"{where}: device buffers are required (io='device')")
    if len(dev.block_ids) != request.num_blocks:
        raise ValueError(
            f"{where}: device.block_ids has {len(dev.block_ids)} ids for "
            f"{request.num_blocks} blocks; one device block per block"
        )
    n_layers = len(dev.layer_ids)
    if len(dev.k_ptrs) != n_layers or len(dev.v_ptrs) != n_layers:
        raise ValueError(
            f"{where}: device.k_ptrs ({len(dev.k_ptrs)}) and device.v_ptrs ({len(dev.v_ptrs)}) "
            f"need one pointer per entry of device.layer_ids ({n_layers})"
        )
    bad = [lid for lid in dev.layer_ids if not 0 <= lid < settings.layer_num]
    if bad:
        raise ValueError(
            f"{where}: device.layer_ids {bad} are outside the SDK's layer_num {settings.layer_num}"
        )
    if dev.layout.dtype.has_scales or dev.k_scale_ptrs or dev.v_scale_ptrs:
        raise ValueError(
            f"{where}: device.layout.dtype {dev.layout.dtype.value} has scale tensors, which "
            "the AttentionStore SDK cannot carry"
        )
    if dev.layout.kv_layer_block_bytes != settings.bytes_per_shard_layer_per_block:
        raise ValueError(
            f"{where}: device.layout has {dev.layout.kv_layer_block_bytes} bytes per layer "
            f"block but the SDK was opened with bytes_per_shard_layer_per_block="
            f"{settings.bytes_per_shard_layer_per_block}"
        )
    if dev.device_id != settings.device_id:
        raise ValueError(
            f"{where}: device.device_id {dev.device_id} is not the SDK's device_id "
            f"{settings.device_id}"
        )
    negative = [b for b in dev.block_ids if b < 0]
    if negative:
        raise ValueError(f"{where}: device.block_ids has negative ids {negative[:4]}")
    return DeviceArgs(
        layer_ids=list(dev.layer_ids),
        k_ptrs=list(dev.k_ptrs),
        v_ptrs=list(dev.v_ptrs),
        block_ids=list(dev.block_ids),
    )


def clamp_count(value: object, limit: int) -> int | None:
    """An SDK block count limited to ``[0, limit]``; None when it is not an integer at all."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return max(0, min(value, limit))
