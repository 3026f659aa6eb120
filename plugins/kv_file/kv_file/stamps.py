"""Write stamps: one number per block, in every part's header, that tells a reader whether the
block's parts come from one write.

A block's parts (K and V, or one per layer) are files of their own, each verified on its own.
A block removed and written again with other bytes while a reader read it could be read as K
from one write and V from the other, every part whole. So every part of a block carries the
block's stamp (:func:`kv_file.objfile.block_stamp`): a digest of the checksums of all its
parts. It is made of the bytes, not of the moment: two writers of the same bytes (two engines
storing one prefix at once) give the same stamp, and their parts may mix freely.

A reader takes a block only when its parts' stamps agree. A block whose parts disagree is a
miss (``read_mixed_blocks``) and is removed while its files still disagree (each file only if
it is still the one looked at), so the next write stores it whole again.

The checksums a stamp is made of are the parts' own, computed once per write: by the native
write batch as it writes (each block's parts written, then their heads, by whichever thread
finishes the block's last part) for unsynced writes of whole blocks; else before the write
(a digest batch, or Python's xxhash), which a synced write did anyway.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection

import numpy as np

from kv_file import objbatch
from kv_file.batch import READ_COUNTERS, Batches
from kv_file.catalog import Catalog
from kv_file.journal import Kind
from kv_file.objfile import block_stamp, checksum, encode_name
from kv_file.objio import ReadOutcome, stamp_in_file
from kv_file.paths import StoreDir, discard
from kvcore import BlockRequest, fileio

__all__ = ["Stamps"]

_HIT = READ_COUNTERS[ReadOutcome.OK]


class Stamps:
    """The write stamps of one opened store's blocks: made for writes, compared on reads.

    :param digest_of: the file digest of an object's name (where its file lives).
    """

    def __init__(
        self,
        store_dir: StoreDir,
        catalog: Catalog,
        batches: Batches,
        digest_of: Callable[[str], int],
    ) -> None:
        self._dir = store_dir
        self._catalog = catalog
        self._batches = batches
        self._digest_of = digest_of

    @staticmethod
    def whole_blocks(request: BlockRequest, planned: Collection[int]) -> bool:
        """Whether the objects ``planned`` to be written are whole blocks, every part of each
        (a native batch can then stamp each block as it writes it)."""
        nparts = len(request.parts)
        return all((k // nparts) * nparts + j in planned for k in planned for j in range(nparts))

    def for_write(
        self, request: BlockRequest, planned: Collection[int], workers: int
    ) -> tuple[dict[int, bytes], list[int]]:
        """For the objects ``planned`` to be written (``k``: flat ``[block][part]`` index):
        each one's checksum (``k`` -> 16 bytes), and each block's stamp (0 for a block with
        nothing to write). A block with some parts stored already has all its parts hashed:
        its stamp covers them too."""
        nparts = len(request.parts)
        blocks = sorted({k // nparts for k in planned})
        ks = [k for i in blocks for k in range(i * nparts, (i + 1) * nparts)]
        sums = dict(zip(ks, self._checksums(request, ks, workers), strict=True))
        stamps = [0] * request.num_blocks
        for i in blocks:
            stamps[i] = block_stamp([sums[k] for k in range(i * nparts, (i + 1) * nparts)])
        return sums, stamps

    def _checksums(self, request: BlockRequest, ks: list[int], workers: int) -> list[bytes]:
        """The checksums (:func:`kv_file.objfile.checksum`) of objects ``ks`` of a request,
        from its host buffers."""
        host = request.host
        assert host is not None
        if not ks:
            return []
        nparts = len(request.parts)
        names = [encode_name(request.object_names[k // nparts][k % nparts]) for k in ks]
        if not objbatch.enabled():
            return [
                checksum(name, host.views(k // nparts, k % nparts))
                for name, k in zip(names, ks, strict=True)
            ]
        rows, starts = host.iovecs()
        objects = np.fromiter(ks, dtype=np.int64, count=len(ks))
        picked = objbatch.Rows(rows, starts).take(objects)
        batch = fileio.digest_batch(picked.rows, picked.starts, digest_prefixes=names)
        self._batches.run_native(batch, workers, sum(host.nbytes[k % nparts] for k in ks))
        return batch.digests()

    def refuse_mixed(
        self, request: BlockRequest, outcomes: list[str], stamps: list[int]
    ) -> set[int]:
        """The blocks of a read whose parts were all read but carry different stamps (parts
        of two writes): each a miss (its parts' ``outcomes`` become ``read_mixed``), counted,
        and removed while its files still disagree. ``stamps``: each object's, as read."""
        nparts = len(request.parts)
        if nparts == 1:
            return set()
        mixed = {
            i
            for i in range(request.num_blocks)
            if all(o == _HIT for o in outcomes[i * nparts : (i + 1) * nparts])
            and len(set(stamps[i * nparts : (i + 1) * nparts])) > 1
        }
        for i in sorted(mixed):
            outcomes[i * nparts : (i + 1) * nparts] = ["read_mixed"] * nparts
            self._remove_if_mixed(request, i)
        if mixed:
            self._batches.count(["read_mixed_blocks"] * len(mixed))
        return mixed

    def _remove_if_mixed(self, request: BlockRequest, block: int) -> None:
        """Remove block ``block``'s files when their stamps still disagree (each only while it
        is the file looked at: a writer's fresh copy renamed over it stays)."""
        digests = [self._digest_of(name) for name in request.object_names[block]]
        seen: list[tuple[str, os.stat_result, int]] = []
        for digest in digests:
            path = self._dir.object_path(digest)
            found = stamp_in_file(path)
            if found is None:  # gone or replaced meanwhile: a later read decides
                return
            seen.append((path, *found))
        if len({stamp for _, _, stamp in seen}) == 1:
            return  # a writer made it whole again meanwhile
        removed = [d for d, (path, st, _) in zip(digests, seen, strict=True) if discard(path, st)]
        self._catalog.gone(removed, Kind.REMOVED)
