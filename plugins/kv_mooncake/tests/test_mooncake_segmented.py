"""Segmented host buffers (an engine's host-resident cache, one piece per layer) against a
live master, beyond the 2048 pieces Mooncake's client takes in one call."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import kvcore
from kvcore.testing import Harness, blocks_equal, harness_opener


@pytest.fixture
def open_h(mooncake_config: dict[str, Any]) -> Iterator[Callable[..., Harness]]:
    with harness_opener("mooncake", mooncake_config) as open_:
        yield open_


def test_more_pieces_than_one_client_call_takes_round_trip(open_h) -> None:
    # 300 blocks x 2 parts x 8 layers = 4800 pieces: one call would lose every key past 2048
    layout = kvcore.CacheLayout(
        num_layers=8, num_heads=1, block_size=4, head_dim=16, num_blocks=300
    )
    h = open_h(layout=layout, namespace=f"seg-{uuid.uuid4().hex[:8]}")
    seq = h.new_sequence(300)
    payload = h.payload(seq, 0, 300)
    source, _ = h.segmented(300, payload)
    written = h.backend.write(h.request(seq, host=source))
    assert (written, written.failure) == (300, None)
    target, extract = h.segmented(300)
    got = h.backend.read(h.request(seq, host=target))
    assert (got, got.failure) == (300, None)
    assert blocks_equal(extract(), payload) == []
    assert h.backend.stats()["backend_unregistered_spans"] == 0
    h.backend.clear()


def test_concurrent_calls_never_overfill_the_clients_transfer_queue(open_h) -> None:
    """Four tasks of 2048 pieces at once: Mooncake's queue takes 2048 pieces in all (one more
    and every call fails after a one-second stall); the backend admits calls as they fit."""
    layout = kvcore.CacheLayout(
        num_layers=8, num_heads=1, block_size=4, head_dim=16, num_blocks=128
    )
    h = open_h(layout=layout, namespace=f"conc-{uuid.uuid4().hex[:8]}")
    seqs = [h.new_sequence(128) for _ in range(4)]
    payloads = [h.payload(seq, 0, 128) for seq in seqs]
    sources = [h.segmented(128, payload)[0] for payload in payloads]
    targets = [h.segmented(128) for _ in seqs]

    def write(i: int) -> kvcore.Outcome:
        return h.backend.write(h.request(seqs[i], host=sources[i]))

    def read(i: int) -> kvcore.Outcome:
        return h.backend.read(h.request(seqs[i], host=targets[i][0]))

    with ThreadPoolExecutor(4) as pool:
        assert [(n, n.failure) for n in pool.map(write, range(4))] == [(128, None)] * 4
        assert [(n, n.failure) for n in pool.map(read, range(4))] == [(128, None)] * 4
    for (_, extract), payload in zip(targets, payloads, strict=True):
        assert blocks_equal(extract(), payload) == []
    h.backend.clear()
