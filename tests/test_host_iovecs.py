"""``HostBuffers.iovecs``: a batch's pieces as ``(address, nbytes)`` rows, the same pieces and
order as :meth:`HostBuffers.segments` gives object by object, for both shapes."""

from __future__ import annotations

import numpy as np

from kvcore import HostBuffers


def _by_segments(host: HostBuffers, parts: int) -> list[list[tuple[int, int]]]:
    return [host.segments(i, j) for i in range(host.num_blocks) for j in range(parts)]


def _by_iovecs(host: HostBuffers) -> list[list[tuple[int, int]]]:
    rows, starts = host.iovecs()
    assert rows.dtype == np.int64 and rows.shape[1] == 2 and starts.dtype == np.int64
    return [
        [(int(a), int(n)) for a, n in rows[starts[k] : starts[k + 1]]]
        for k in range(len(starts) - 1)
    ]


def test_contiguous_buffers_give_one_row_per_object_in_block_part_order() -> None:
    host = HostBuffers(ptrs=((4096, 8192, 12288), (1 << 47, (1 << 47) + 64, 5)), nbytes=(64, 32, 8))
    assert _by_iovecs(host) == _by_segments(host, 3)


def test_segmented_buffers_give_one_row_per_layer_of_each_part() -> None:
    host = HostBuffers(
        ptrs=(),
        nbytes=(3 * 256, 2 * 128),
        layer_ptrs=((1 << 40, 2 << 40, 3 << 40), (4 << 40, 5 << 40)),  # parts of 3 and 2 layers
        block_ids=(7, 0, 3),
        segment_nbytes=(256, 128),
    )
    assert _by_iovecs(host) == _by_segments(host, 2)
    assert _by_iovecs(host.slice(1, 3)) == _by_segments(host.slice(1, 3), 2)


def test_no_blocks_give_no_rows() -> None:
    rows, starts = HostBuffers(ptrs=(), nbytes=(8,)).iovecs()
    assert rows.shape == (0, 2) and starts.tolist() == [0]
