"""Segmented host buffers (an engine's host-resident cache, one piece per layer) against a
live master, beyond the 2048 pieces Mooncake's client takes in one call."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
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
