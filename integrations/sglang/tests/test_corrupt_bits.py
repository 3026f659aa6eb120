"""A bit flipped in a stored page object never reaches SGLang's host pool (issue 37).

The backend SGLang's storage opens verifies its own blocks (kvcore.integrity): memory and a
real Mooncake on 127.0.0.1 keep no checksums, so kvcore keeps a digest beside every page and
a flipped bit ends the read before that page, counted, and the page is a miss afterwards.
"""

from __future__ import annotations

import pytest
from conftest import page_bytes, page_indices, page_keys
from kvcore_sglang.testing import fill_random, mha_host_pool, mla_host_pool

from kvcore.testing.corruption import corrupt_reads, flip_a_stored_bit


@pytest.mark.parametrize("backend_spec", ["memory", "mooncake"], indirect=True)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_flipped_bit_is_never_read_into_the_pool(make_storage, kind: str) -> None:
    pool = mha_host_pool("page_first") if kind == "mha" else mla_host_pool("page_first")
    fill_random(pool, 5)
    storage = make_storage(pool, is_mla=kind == "mla")
    keys = page_keys(3, seed=5)
    assert storage.batch_set_v1(keys, page_indices(pool, 0, 3)) == [True] * 3

    tier = storage._kv_tier()
    backend = tier.backend
    probe = storage._io.request("probe", tier, storage._kv_format, keys)(backend)
    sizes = probe.part_nbytes or [backend.context.layout.part_bytes(p) for p in probe.parts]
    flip_a_stored_bit(backend, probe.object_names[1][-1], sizes[-1])

    assert storage.batch_get_v1(keys, page_indices(pool, 10, 3)) == [True, False, False]
    assert page_bytes(pool, 10, 1) == page_bytes(pool, 0, 1)
    assert corrupt_reads(backend) == 1
    assert storage.batch_exists(keys) == 1, "the corrupt page is still found"
