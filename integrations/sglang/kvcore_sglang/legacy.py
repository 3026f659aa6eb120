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
    done = io.outcome("get", tier.backend.read(io.request("get", tier, fmt, keys, host)))
    for target, landed in zip(targets[:done], landing[:done], strict=True):
        if landed is not target:
            target.copy_(landed.view(target.dtype).view(target.shape))
    io.counters.add("pages_read", len(keys))
    io.counters.add("pages_read_ok", done)
    return [*targets[:done], *([None] * (len(keys) - done))]


def read_pointers(
    io: PageTransfers, tier: Tier, fmt: PageFormat, keys: list[str], locations: Any, sizes: Any
) -> int:
    """Read pages into raw addresses (``locations`` with ``sizes``); the leading pages read."""
    if not keys:
        return 0
    host = pointer_buffers(fmt, locations, sizes)
    done = io.outcome("get", tier.backend.read(io.request("get", tier, fmt, keys, host)))
    io.counters.add("pages_read", len(keys))
    io.counters.add("pages_read_ok", done)
    return done


def write_tensors(
    io: PageTransfers,
    tier: Tier,
    fmt: PageFormat,
    keys: list[str],
    values: Sequence[torch.Tensor] | None,
    writer: bool,
) -> bool:
    """Store flat page tensors (the admitted leading run of them); whether every page is."""
    if not keys:
        return True
    if values is None or len(values) != len(keys):
        raise ValueError("batch_set needs one page tensor per key")
    if not writer:
        return io.exists(tier, fmt, keys) == len(keys)
    request = io.request("set", tier, fmt, keys)
    admitted = io.admitted(tier, request)
    if admitted == 0:
        return True
    keys = keys[:admitted]
    pages = [v.contiguous().cpu() for v in values[:admitted]]  # pool views: zero-copy
    host = tensor_buffers(fmt, pages)
    done = io.outcome("set", tier.backend.write(request.slice(0, admitted, host=host)))
    io.counters.add("pages_written", len(keys))
    io.counters.add("pages_written_ok", done)
    return done == len(keys)


def write_pointers(
    io: PageTransfers,
    tier: Tier,
    fmt: PageFormat,
    keys: list[str],
    locations: Any,
    sizes: Any,
    writer: bool,
) -> bool:
    """Store pages at raw addresses (the admitted leading run of them); whether every page is."""
    if not keys:
        return True
    if not writer:
        return io.exists(tier, fmt, keys) == len(keys)
    request = io.request("set", tier, fmt, keys)
    if len(locations) == len(sizes) == len(keys):  # else pointer_buffers says what is wrong
        admitted = io.admitted(tier, request)
        if admitted == 0:
            return True
        keys = keys[:admitted]
        locations, sizes = locations[:admitted], sizes[:admitted]
    host = pointer_buffers(fmt, locations, sizes)
    done = io.outcome("set", tier.backend.write(request.slice(0, len(keys), host=host)))
    io.counters.add("pages_written", len(keys))
    io.counters.add("pages_written_ok", done)
    return done == len(keys)


def _flat_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8)
