"""Removing data (``kvcore_remove``, ``kvcore_clear``): a remove deletes exactly the requested
blocks, of one rank, and every instance sharing the store sees it; a clear empties the
namespace, every rank's, and no other."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from kvcore.backend import Backend
from kvcore.testing.harness import Harness, Sequence_, blocks_equal
from kvcore.testing.kit.fixtures import KitFixtures, _rank_layout, _require_hook, _sees
from kvcore.testing.kit.marks import DATA_HOOKS, exercises, requires

__all__ = ["RemovalTests"]


class RemovalTests(KitFixtures):
    """Remove and clear drop what they are asked to, and nothing else."""

    # -- removing data ---------------------------------------------------------------------

    @exercises("kvcore_remove", *DATA_HOOKS)
    def test_remove_deletes_the_requested_blocks(self, harness: Harness) -> None:
        backend, seq = _stored_for_removal(harness, 5)
        removed = backend.remove(harness.request(seq, 3, 2))
        assert removed == 2, f"remove of 2 stored blocks reported {int(removed)}"
        assert harness.query(seq, 3) == 0, "removed blocks are still found"
        assert harness.read(seq, 3)[0] == 0, "removed blocks can still be read"
        assert harness.query(seq) == 3, "remove of blocks 3-4 dropped blocks 0-2"
        harness.assert_reads_back(seq, 3)
        again = backend.remove(harness.request(seq, 3, 2))
        assert again == 0, f"a second remove of the same blocks reported {int(again)}"
        never = backend.remove(harness.request(harness.new_sequence(2)))
        assert never == 0, f"remove of never-stored blocks reported {int(never)}"
        partly = backend.remove(harness.request(seq))
        assert partly == 3, f"remove of 5 blocks of which 3 were stored reported {int(partly)}"
        assert harness.query(seq) == 0
        assert harness.write(seq) == 5, "blocks cannot be written again after a remove"
        harness.assert_reads_back(seq, 5)

    @requires(addressing="key")
    @exercises("kvcore_remove", *DATA_HOOKS)
    def test_remove_of_middle_blocks_keeps_the_others(self, harness: Harness) -> None:
        backend, seq = _stored_for_removal(harness, 5)
        assert backend.remove(harness.request(seq, 1, 2)) == 2
        assert harness.query(seq) == 1
        assert harness.query(seq, 3) == 2, "remove of blocks 1-2 dropped blocks 3-4"
        done, got = harness.read(seq, 3)
        assert done == 2 and blocks_equal(got, harness.payload(seq, 3, 2)) == []

    @exercises("kvcore_remove", "kvcore_write", "kvcore_query")
    def test_remove_is_per_rank_and_seen_by_every_instance(
        self,
        open_harness: Callable[..., Harness],
        backend_context: dict[str, Any],
    ) -> None:
        world, rank, other_rank, _ = _rank_layout(backend_context)
        own = open_harness(rank=rank, world_size=world)
        _require_hook(own.backend, "kvcore_remove")
        twin = open_harness(rank=rank, world_size=world)
        peer = open_harness(rank=other_rank, world_size=world)
        seq = own.new_sequence(3)
        assert own.write(seq) == 3
        assert peer.write(seq, version=1) == 3
        assert peer.backend.remove(peer.request(seq)) == 3
        assert peer.query(seq) == 0
        assert own.query(seq) == 3, f"rank {other_rank}'s remove dropped rank {rank}'s blocks"
        if _sees(twin, seq, 3):  # the instances share one store: removal is seen by all
            removed = twin.backend.remove(twin.request(seq))
            assert removed == 3
            left = own.query(seq)
            assert left == 0, (
                f"blocks removed through another instance sharing the store are still found "
                f"by this one ({int(left)} of 3)"
            )
            assert own.read(seq)[0] == 0

    @exercises("kvcore_clear", *DATA_HOOKS)
    def test_clear_empties_the_namespace_for_every_rank_and_no_other(
        self, open_harness: Callable[..., Harness]
    ) -> None:
        # namespaces of the kit's own: a clear must never touch data the kit did not write
        cleared_ns = f"kvcore-kit-{uuid.uuid4().hex[:12]}"
        kept_ns = f"{cleared_ns}-kept"
        own = open_harness(rank=0, world_size=2, namespace=cleared_ns)
        _require_hook(own.backend, "kvcore_clear")
        twin = open_harness(rank=0, world_size=2, namespace=cleared_ns)
        other_rank = open_harness(rank=1, world_size=2, namespace=cleared_ns)
        other_twin = open_harness(rank=1, world_size=2, namespace=cleared_ns)
        other_ns = open_harness(rank=0, world_size=2, namespace=kept_ns)
        seq = own.new_sequence(3)
        for version, h in enumerate((own, other_rank, other_ns)):
            assert h.write(seq, version=version) == 3
        # the other rank's blocks are held to the clear once another instance sees them: a
        # store whose writes reach the shared part later (a private first tier copying down
        # in the background) may not have them there yet, and one instance cannot clear
        # another's private memory
        shared = _sees(twin, seq, 3) and _sees(other_twin, seq, 3)
        objects = 3 * len(own.parts) * (2 if shared else 1)
        removed = own.backend.clear()
        assert removed == 0 or removed >= objects, (
            f"clear reported {int(removed)} objects removed; the namespace held at least "
            f"{objects} (0 is allowed for stores that cannot count)"
        )
        assert own.query(seq) == 0, "blocks are still found after clear"
        assert own.read(seq)[0] == 0, "blocks can still be read after clear"
        if shared:
            assert other_rank.query(seq) == 0, "clear left another rank's blocks in the namespace"
        done, got = other_ns.read(seq)
        assert done == 3, "clear removed blocks of another namespace"
        assert blocks_equal(got, other_ns.payload(seq, 0, 3, 2)) == []
        assert own.write(seq) == 3, "blocks cannot be written again after clear"
        done, got = own.read(seq)
        assert done == 3 and blocks_equal(got, own.payload(seq, 0, 3)) == []
        own.backend.clear()
        other_ns.backend.clear()


# -- helpers ---------------------------------------------------------------------------------


def _stored_for_removal(harness: Harness, n: int) -> tuple[Backend, Sequence_]:
    """The harness's backend (skipping when it has no ``kvcore_remove``) and ``n`` blocks
    written to it."""
    _require_hook(harness.backend, "kvcore_remove")
    seq = harness.new_sequence(n)
    assert harness.write(seq) == n
    return harness.backend, seq
