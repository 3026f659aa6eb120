"""The facade's door: what a read's or a write's request must be before any backend sees it.

What the hook spec promises a backend about a request's buffers, checked once where the
request enters the core (:meth:`kvcore.Backend.read` and ``write``); requests built by
:meth:`kvcore.Backend.request` and sliced by the core are well-formed by construction, so
nothing below re-checks them.

.. versionadded:: 0.3 (the facade's own method before)
"""

from __future__ import annotations

from kvcore.requests import BlockRequest
from kvcore.schemas import BackendContext, Capabilities

__all__ = ["check_buffers"]


def check_buffers(
    request: BlockRequest,
    op: str,
    name: str,
    context: BackendContext,
    capabilities: Capabilities,
    sizes: list[int] | None,
) -> None:
    """Raise ValueError where ``request`` breaks what backend ``name`` is promised for ``op``
    (``read`` or ``write``): a lookup-only opener asked to move blocks, names or buffers for
    another count of blocks, buffers of the wrong kind, or of sizes other than ``sizes`` (the
    parts' sizes, None when unknown). O(1) per request, plus the part sizes."""
    if context.role == "lookup" and (op == "write" or not capabilities.lookup_reads):
        raise ValueError(
            f"backend {name!r} was opened for lookups (context role 'lookup'): it "
            f"cannot {op}; open it with role 'data' to move blocks"
        )
    n = request.num_blocks
    if request.block_keys and len(request.object_names) != n:
        raise ValueError(f"object_names has {len(request.object_names)} rows for {n} blocks")
    if capabilities.io == "device":
        if request.device is None:
            raise ValueError(
                f"backend {name!r} does device I/O: the request needs `device` buffers"
            )
        if len(request.device.block_ids) != n:
            raise ValueError(
                f"device.block_ids has {len(request.device.block_ids)} ids for {n} blocks"
            )
        return
    host = request.host
    if host is None:
        raise ValueError(f"backend {name!r} does host I/O: the request needs `host` buffers")
    if host.num_blocks != n:
        raise ValueError(f"host buffers hold {host.num_blocks} blocks; the request has {n}")
    if sizes is not None and list(host.nbytes) != sizes:
        raise ValueError(
            f"host.nbytes {list(host.nbytes)} differ from the part sizes {sizes} (parts "
            f"{list(request.parts)}): a short buffer would store a truncated object"
        )
    if not host.contiguous and not capabilities.segmented_host:
        raise ValueError(
            f"backend {name!r} does not take segmented host buffers "
            "(Capabilities.segmented_host is False)"
        )
