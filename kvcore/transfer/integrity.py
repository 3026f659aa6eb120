"""Deprecated: block digests are the opened backend's now (:mod:`kvcore.integrity`).

.. deprecated:: 0.3 an opened :class:`kvcore.Backend` keeps and checks block digests itself
   (``open_backend(..., verify_blocks=...)``), for every caller. ``VerifiedBlocks`` is kept for
   one release as a pass-through, so code that wrapped a backend by hand keeps working (and
   verifies once, not twice); it goes in 0.4.
"""

from __future__ import annotations

import warnings

from kvcore.backend import Backend
from kvcore.integrity import DIGEST_PART
from kvcore.requests import BlockRequest, Outcome

__all__ = ["DIGEST_PART", "VerifiedBlocks"]


class VerifiedBlocks:
    """Deprecated pass-through to ``backend`` (which verifies its blocks itself)."""

    def __init__(self, backend: Backend, parts: int = 0) -> None:
        warnings.warn(
            "kvcore.transfer.integrity.VerifiedBlocks is deprecated: an opened backend keeps "
            "block digests itself (open_backend(..., verify_blocks=...)); use it directly",
            DeprecationWarning,
            stacklevel=2,
        )
        self.backend = backend
        self.name = backend.name

    def query(self, request: BlockRequest) -> Outcome:
        return self.backend.query(request)

    def read(self, request: BlockRequest) -> Outcome:
        return self.backend.read(request)

    def write(self, request: BlockRequest) -> Outcome:
        return self.backend.write(request)

    def remove(self, request: BlockRequest) -> Outcome:
        return self.backend.remove(request)

    def implements(self, hook: str) -> bool:
        return self.backend.implements(hook)
