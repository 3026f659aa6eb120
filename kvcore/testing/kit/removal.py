"""Removing data (``kvcore_remove``, ``kvcore_clear``, ``kvcore_clear_tenant``): a remove
deletes exactly the requested blocks, of one rank, and every instance sharing the store sees
it; a clear empties the namespace, every rank's, and no other; a tenant's clear removes what
that tenant stored, and nothing of another tenant's."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from kvcore.backend import Backend
from kvcore.requests import FailureKind
from kvcore.testing.harness import Harness, Sequence_, blocks_equal
from kvcore.testing.kit.fixtures import (
    KitFixtures,
    _rank_layout,
    _require_hook,
    _sees,
    harness_opener,
)
from kvcore.testing.kit.marks import DATA_HOOKS, exercises, requires

__all__ = ["RemovalTests", "race_rewrites"]


class RemovalTests(KitFixtures):
    """Remove and clear drop what they are asked to, and nothing else."""

    #: blocks :meth:`test_a_block_rewritten_while_it_is_read_is_read_as_one_write` checks (a
    #: backend's own tests may ask for more)
    rewrite_race_blocks = 2_000

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

    @exercises("kvcore_remove", "kvcore_write", "kvcore_read")
    def test_a_block_rewritten_while_it_is_read_is_read_as_one_write(
        self,
        backend_target: str | type,
        backend_config: dict[str, Any],
        backend_context: dict[str, Any],
    ) -> None:
        """Blocks removed and written again with other bytes, over and over, while another
        thread reads them: every block a read counts holds one write's bytes in every part.
        A block of K from one write and V from another verifies part by part, but no engine
        computed it (a wrong token).

        Opened as every caller opens it (``verify_blocks="auto"``): a backend that keeps no
        checksums gets kvcore's block digests, which catch such a block; one that keeps its
        own must catch it itself. Bounded by work: reads until :attr:`rewrite_race_blocks`
        blocks came back (or 50 reads per block asked, for a store that loses every race),
        whatever the machine's speed.

        .. versionadded:: 0.3
        """
        with harness_opener(
            backend_target, backend_config, backend_context, verify_blocks="auto"
        ) as open_:
            harness = open_()
            backend, seq = _stored_for_removal(harness, _RACE_BLOCKS)
            checked, mixed, rewrites = race_rewrites(
                harness, backend, seq, self.rewrite_race_blocks
            )
        assert mixed == [], (
            f"{len(mixed)} of {checked} blocks read came back as parts of two writes (or other "
            f"bytes): {mixed[:5]}"
        )
        assert rewrites >= 2, "the test never raced: the blocks were rewritten less than twice"

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

    @exercises("kvcore_clear_tenant", *DATA_HOOKS)
    def test_clearing_a_tenant_removes_its_blocks_and_no_other_tenants(
        self, open_harness: Callable[..., Harness]
    ) -> None:
        """.. versionadded:: 0.3"""
        own = open_harness()
        _require_hook(own.backend, "kvcore_clear_tenant")
        twin = open_harness()
        # tenants of the kit's own: a clear must never touch data the kit did not write
        kept, cleared = (f"kit-{uuid.uuid4().hex[:12]}" for _ in range(2))
        a, b = own.new_sequence(3), own.new_sequence(3)
        assert own.write(a, tenant=kept) == 3 and own.write(b, tenant=cleared) == 3
        removed = own.backend.clear(tenant=cleared)
        if removed.kind is FailureKind.UNSUPPORTED:
            pytest.skip(f"the backend cannot clear one tenant: {removed.failure}")
        assert removed.failure is None, f"clearing a tenant failed: {removed.failure}"
        objects = 3 * len(own.parts)
        assert removed == 0 or removed >= objects, (
            f"a tenant's clear reported {int(removed)} objects removed; it held {objects} (0 "
            "is allowed for stores that cannot count)"
        )
        assert own.query(b) == 0, "the cleared tenant's blocks are still found"
        assert own.read(b)[0] == 0, "the cleared tenant's blocks can still be read"
        own.assert_reads_back(a, 3)  # the other tenant's, every byte
        if _sees(twin, a, 3):
            assert twin.query(b) == 0, "another instance still finds the cleared tenant's blocks"
        assert own.write(b, tenant=cleared) == 3, "the tenant cannot write again after its clear"
        own.assert_reads_back(b, 3)
        unknown = own.backend.clear(tenant=f"kit-{uuid.uuid4().hex[:12]}")
        assert unknown == 0


# -- helpers ---------------------------------------------------------------------------------

#: blocks the rewrite race reads at once
_RACE_BLOCKS = 8


def race_rewrites(
    harness: Harness, backend: Backend, seq: Sequence_, wanted: int
) -> tuple[int, list[str], int]:
    """Read ``seq`` (stored, version 0) while a thread removes it and writes it again as
    version 1, 0, 1, ...: until ``wanted`` blocks came back and two rewrites were done (at
    most ``50 * wanted`` reads).
    Returns the blocks read, those whose parts are not all one version's, and the rewrites.
    For a backend's own tests of the race at a larger scale.

    .. versionadded:: 0.3
    """
    n = len(seq.keys)
    payloads = [harness.payload(seq, 0, n, v) for v in (0, 1)]
    stop = threading.Event()
    rewrites: list[int] = []
    failed: list[BaseException] = []

    def rewrite() -> None:
        version = 0
        try:
            while not stop.is_set():
                version ^= 1
                backend.remove(harness.request(seq))
                harness.write(seq, version=version)
                rewrites.append(version)
        except BaseException as exc:  # reported by the test, not lost in the thread
            failed.append(exc)

    checked = reads = 0
    mixed: list[str] = []
    rewriter = threading.Thread(target=rewrite, name="kit-rewriter", daemon=True)
    rewriter.start()
    try:
        # enough blocks, and the blocks rewritten twice at least (a slow store's rewrites)
        while (checked < wanted or len(rewrites) < 2) and reads < 50 * wanted and not failed:
            reads += 1
            done, got = harness.read(seq)
            for i in range(int(done)):
                if not any(got[i] == p[i] for p in payloads):
                    same = [[a == b for a, b in zip(got[i], p[i], strict=True)] for p in payloads]
                    mixed.append(f"block {i} of read {reads} (parts equal to v0, v1: {same})")
            checked += int(done)
    finally:
        stop.set()
        rewriter.join(60)
    assert not failed, f"the rewriting thread failed: {failed[0]!r}"
    assert not rewriter.is_alive(), "a remove or write hung"
    return checked, mixed, len(rewrites)


def _stored_for_removal(harness: Harness, n: int) -> tuple[Backend, Sequence_]:
    """The harness's backend (skipping when it has no ``kvcore_remove``) and ``n`` blocks
    written to it."""
    _require_hook(harness.backend, "kvcore_remove")
    seq = harness.new_sequence(n)
    assert harness.write(seq) == n
    return harness.backend, seq
