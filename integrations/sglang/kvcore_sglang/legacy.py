"""The legacy API's I/O (``get``/``set``, ``batch_get``/``batch_set``): KV pages as flat page
tensors, or as raw addresses with their sizes, on the KV tier.

Each function takes the tier and page format of the KV pool and the storage's
:class:`~kvcore_sglang.transfers.PageTransfers`; writes by a rank that is not the storage
writer report whether the pages are stored already.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import kvcore
from kvcore_sglang.pages import PageFormat, pointer_buffers, tensor_buffers
from kvcore_sglang.tiers import Tier
from kvcore_sglang.transfers import PageTransfers

__all__ = ["read_pointers", "read_tensors", "write_pointers", "write_tensors"]


def read_tensors(
    io: PageTransfers,
    tier: Tier,
    fmt: PageFormat,
    keys: list[str],
    targets: Sequence[torch.Tensor] | None,
) -> list[torch.Tensor | None]:
    """Read pages into ``targets`` (one flat page tensor per key); the targets read, then None
    from the first page not read."""
    if not keys:
        return []
    if targets is None or len(targets) != len(keys):
        raise ValueError("batch_get needs one target page tensor per key")
    # read into the targets themselves when they are contiguous, else into stand-ins
    landing = [
        t if t.is_contiguous() and t.device.type == "cpu" else _flat_like(t) for t in targets
    ]
    host = tensor_buffers(fmt, landing)
    done = tier.runner.read(io.request("get", tier, fmt, keys, host), blocks=len(keys)).leading
    for target, landed in zip(targets[:done], landing[:done], strict=True):
        if landed is not target:
            target.copy_(landed.view(target.dtype).view(target.shape))
    return [*targets[:done], *([None] * (len(keys) - done))]


def read_pointers(
    io: PageTransfers, tier: Tier, fmt: PageFormat, keys: list[str], locations: Any, sizes: Any
) -> int:
    """Read pages into raw addresses (``locations`` with ``sizes``); the leading pages read."""
    if not keys:
        return 0
    host = pointer_buffers(fmt, locations, sizes)
    return tier.runner.read(io.request("get", tier, fmt, keys, host), blocks=len(keys)).leading


def write_tensors(
    io: PageTransfers,
    tier: Tier,
    fmt: PageFormat,
    keys: list[str],
    values: Sequence[torch.Tensor] | None,
    writer: bool,
) -> bool:
    """Store flat page tensors (what the store admits of them); whether every page is stored
    or refused by the store's admission."""
    if not keys:
        return True
    if values is None or len(values) != len(keys):
        raise ValueError("batch_set needs one page tensor per key")
    if not writer:
        return io.exists(tier, fmt, keys).leading == len(keys)
    for i, value in enumerate(values):  # the caller's error raises here, before any offer
        nbytes = value.numel() * value.element_size()
        if nbytes != fmt.page_nbytes:
            raise ValueError(f"page {i}: {nbytes} bytes; one page is {fmt.page_nbytes}")
    pages: list[torch.Tensor] = []  # alive until the write returns

    def fill(request: kvcore.BlockRequest, admitted: int) -> kvcore.HostBuffers:
        pages.extend(v.contiguous().cpu() for v in values[:admitted])  # pool views: zero-copy
        return tensor_buffers(fmt, pages)

    result = tier.runner.write(io.request("set", tier, fmt, keys), blocks=len(keys), fill=fill)
    return result.ok


def write_pointers(
    io: PageTransfers,
    tier: Tier,
    fmt: PageFormat,
    keys: list[str],
    locations: Any,
    sizes: Any,
    writer: bool,
) -> bool:
    """Store pages at raw addresses (what the store admits of them); whether every page is
    stored or refused by the store's admission."""
    if not keys:
        return True
    if not writer:
        return io.exists(tier, fmt, keys).leading == len(keys)
    host = pointer_buffers(fmt, locations, sizes)  # no copy: checked before any offer
    if host.num_blocks != len(keys):
        raise ValueError(f"{host.num_blocks} page locations for {len(keys)} keys")
    result = tier.runner.write(io.request("set", tier, fmt, keys, host), blocks=len(keys))
    return result.ok


def _flat_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8)
