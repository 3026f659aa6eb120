"""The object names of the requests the stack builds itself, typed wherever kvcore's are.

A request's names carry their identity when kvcore built them (:class:`kvcore.keys.NameRows`,
``typed``); the digests beside a tier's blocks (:mod:`kvcore.integrity`) are found from that
identity, and only plain rows are read back from their text. So the stack keeps the identity
where it keeps some of a request's blocks (:func:`take`), and builds it again where names
reach it as text with their identity beside (a tier's events: :func:`single_part_rows`) or
as text alone (an eviction hand-over: :func:`is_kvcore_name`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvcore import BlockRequest
from kvcore.keys import BlockId, NameRows, ObjectName, object_names

__all__ = ["is_kvcore_name", "rows_of_blocks", "single_part_rows", "take"]


def take(request: BlockRequest, rows: Sequence[int]) -> BlockRequest:
    """``request`` with only the blocks ``rows`` (names, keys and block metadata; no
    buffers). Names kvcore built keep their identity (:meth:`NameRows.take`)."""
    names = request.object_names
    meta = request.block_meta
    return replace(
        request,
        block_keys=tuple(request.block_keys[i] for i in rows) if request.block_keys else (),
        object_names=names.take(rows)
        if isinstance(names, NameRows)
        else tuple(names[i] for i in rows),
        # each kept block's own metadata: a write of the kept blocks stores it with them
        block_meta=None if meta is None else tuple(meta[i] for i in rows),
        num_blocks=len(rows),
        host=None,
    )


def is_kvcore_name(name: str, identity: ObjectName | None, namespace: str | None = None) -> bool:
    """Whether ``name`` is exactly the name kvcore builds for ``identity`` (in ``namespace``,
    when given). Only then may typed names stand in for it: parsing accepts a few spellings
    (``r01of2``, an empty ``/w``) that kvcore never builds, and those must keep their text."""
    if identity is None or (namespace is not None and identity.namespace != namespace):
        return False
    return identity.format() == name


def rows_of_blocks(blocks: Sequence[BlockId], parts: Sequence[str]) -> NameRows:
    """The typed names of ``parts`` of ``blocks``, which share one namespace and scope (rank,
    world size, weight version)."""
    first = blocks[0]
    return object_names(
        [b.block_key for b in blocks],
        parts,
        namespace=first.namespace,
        rank=first.rank,
        world_size=first.world_size,
        weight_version=first.weight_version,
    )


def single_part_rows(
    part: str, names: Sequence[str], identities: Sequence[ObjectName | None]
) -> list[Sequence[tuple[str, ...]]]:
    """The names of part ``part`` of some blocks (one object each), as the rows of one
    request per scope: typed for names kvcore built (so the digests beside them are found
    by their identity), plain rows for any other name."""
    scopes: dict[tuple[str, int, int, str], list[BlockId]] = {}
    plain: list[tuple[str, ...]] = []
    for name, identity in zip(names, identities, strict=True):
        if identity is None or identity.part != part or not is_kvcore_name(name, identity):
            plain.append((name,))
            continue
        block = identity.block
        scope = (block.namespace, block.rank, block.world_size, block.weight_version)
        scopes.setdefault(scope, []).append(block)
    out: list[Sequence[tuple[str, ...]]] = [rows_of_blocks(b, (part,)) for b in scopes.values()]
    if plain:
        out.append(tuple(plain))
    return out
