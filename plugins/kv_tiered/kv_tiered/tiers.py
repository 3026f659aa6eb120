"""The opened tiers of a stack, and how each is read and written.

Each tier is a :class:`kvcore.Backend` opened by name with the stack's context. An opened
backend verifies its own blocks (kv_file by its checksums; memory and Mooncake by the block
digests their facades keep beside every block, :mod:`kvcore.integrity`), so every read the
stack serves is verified, whichever tier it comes from, and each tier has one facade.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, overload

import kvcore
from kvcore import BlockRequest

__all__ = ["Tiers"]

log = logging.getLogger("kvcore.tiered")


class Tiers(Sequence[kvcore.Backend]):
    """The tiers, fastest first (a sequence of opened backends)."""

    def __init__(self, specs: Sequence[Any], context: kvcore.BackendContext) -> None:
        self.context = context
        self._tiers: list[kvcore.Backend] = []
        try:
            for i, spec in enumerate(specs):
                self._tiers.append(_open_tier(i, spec.backend, spec.config, context))
        except BaseException:
            self.close()
            raise

    @overload
    def __getitem__(self, i: int) -> kvcore.Backend: ...
    @overload
    def __getitem__(self, i: slice) -> list[kvcore.Backend]: ...
    def __getitem__(self, i: int | slice) -> kvcore.Backend | list[kvcore.Backend]:
        return self._tiers[i]

    def __len__(self) -> int:
        return len(self._tiers)

    def part_bytes(self, request: BlockRequest) -> Sequence[int] | None:
        """Bytes of each part of ``request``'s objects (None: unknown without a layout)."""
        if request.part_nbytes is not None:
            return request.part_nbytes
        layout = self.context.layout
        if layout is None:
            return None
        return [layout.part_bytes(p) for p in request.parts]

    def close(self) -> None:
        for tier in reversed(self._tiers):
            try:
                tier.close()
            except Exception as exc:  # closing the others matters more
                log.warning("kv_tiered: closing tier %r failed: %s", tier.name, exc)


def _open_tier(
    index: int, name: str, config: dict[str, Any], context: kvcore.BackendContext
) -> kvcore.Backend:
    """Open tier ``index``; an error names it (``tiers[1] (mooncake): ...``)."""
    where = f"tiers[{index}] ({name})"
    # a stack takes key-addressed, host-I/O backends without a token index
    needs = {"addressing": "key", "io": "host", "token_index": False}
    try:
        return kvcore.BackendHandle(name, config, context=context, requires=needs).open()
    except kvcore.ConfigError as exc:
        raise kvcore.ConfigError(f"invalid config for backend 'tiered': {where}: {exc}") from None
    except kvcore.KVCoreError:
        raise
    except Exception as exc:
        raise kvcore.ConfigError(
            f"backend 'tiered': {where} cannot open: {type(exc).__name__}: {exc}"
        ) from exc
