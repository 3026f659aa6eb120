"""Sharing a store: two tensor-parallel ranks and two namespaces on one store never see,
overwrite or skip each other's objects, a second instance of a shared store sees what the
first wrote, and concurrent callers of one instance each get their own bytes back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvcore.schemas import Capabilities
from kvcore.testing.harness import Harness, blocks_equal
from kvcore.testing.kit.fixtures import KitFixtures, _rank_layout, _sees
from kvcore.testing.kit.marks import DATA_HOOKS, exercises

__all__ = ["SharingTests"]


class SharingTests(KitFixtures):
    """Ranks, namespaces, instances and threads on one store stay apart."""

    # -- ranks and namespaces --------------------------------------------------------------

    @exercises(*DATA_HOOKS)
    def test_ranks_and_namespaces_sharing_a_store_stay_apart(
        self,
        open_harness: Callable[..., Harness],
        backend_context: dict[str, Any],
        capabilities: Capabilities,
    ) -> None:
        """Two tensor-parallel ranks hold different slices of the same blocks, and two
        namespaces (models) may hold the same token path: on one store, neither may see,
        overwrite or skip the other's objects."""
        world, rank, other_rank, namespace = _rank_layout(backend_context)
        own = open_harness(rank=rank, world_size=world)
        twin = open_harness(rank=rank, world_size=world)  # another process, same context
        other_ns = f"{namespace}-kit-peer"
        peers = {
            f"rank {other_rank} of {world}": open_harness(rank=other_rank, world_size=world),
            f"namespace {other_ns!r}": open_harness(
                rank=rank, world_size=world, namespace=other_ns
            ),
        }
        seq = own.new_sequence(3)
        assert own.write(seq, version=0) == 3
        shared = _sees(twin, seq, 3)
        if capabilities.shared:
            assert shared, (
                "the backend declares shared=True, but a second instance opened with the same "
                "config and context does not see the blocks the first one wrote"
            )
        where = f"rank {rank} of {world} in namespace {namespace!r}"
        for version, (label, peer) in enumerate(peers.items(), start=1):
            seen = peer.query(seq)
            assert seen == 0, (
                f"{label} finds {int(seen)} blocks that only {where} wrote: object names must "
                "include rank and namespace (else ranks overwrite each other's slices)"
            )
            assert peer.read(seq)[0] == 0, f"{label} reads blocks that only {where} wrote"
            assert peer.write(seq, version=version) == 3
            done, got = peer.read(seq)
            assert done == 3
            assert blocks_equal(got, peer.payload(seq, 0, 3, version)) == [], (
                f"{label} reads back other bytes than it wrote (another rank's or namespace's?)"
            )
        done, got = own.read(seq)
        assert done == 3
        assert blocks_equal(got, own.payload(seq, 0, 3, 0)) == [], (
            f"{where} reads back bytes another rank or namespace wrote under the same blocks"
        )
        if shared:
            done, got = twin.read(seq)
            assert done == 3 and blocks_equal(got, own.payload(seq, 0, 3, 0)) == []

    # -- concurrency -----------------------------------------------------------------------

    @exercises("kvcore_write", "kvcore_read")
    def test_concurrent_callers(self, harness: Harness) -> None:
        shared = harness.new_sequence(4)
        errors: list[str] = []

        def worker(k: int) -> None:
            try:
                own = harness.new_sequence(3)
                for _ in range(3):
                    assert harness.write(own) == 3
                    assert harness.write(shared) == 4
                    done, got = harness.read(own)
                    assert done == 3 and blocks_equal(got, harness.payload(own, 0, 3)) == []
                    done, got = harness.read(shared)
                    assert done == 4 and blocks_equal(got, harness.payload(shared, 0, 4)) == []
            except BaseException as exc:
                errors.append(f"worker {k}: {exc!r}")

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a concurrent call hung"
        assert errors == []
