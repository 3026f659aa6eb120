"""SGLang's HiCacheController storage code paths (backup, hit query, prefetch transfer) run
against the kvcore storage: the calls, batch sizes and hashes are SGLang's own.

The controller's constructor needs a GPU device pool, so it is bypassed (see
``kvcore_sglang.testing.controller_for``).
"""

from __future__ import annotations

import pytest
from conftest import ALL_BACKENDS, page_bytes, page_indices
from kvcore_sglang.testing import (
    controller_for,
    create_storage,
    fill_random,
    mha_host_pool,
    storage_config,
)
from sglang.srt.managers.cache_controller import PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
from sglang.srt.mem_cache.utils import get_storage_hash_str


@pytest.mark.parametrize("backend_spec", ALL_BACKENDS, indirect=True)
@pytest.mark.parametrize("zero_copy", [True, False], ids=["interface_v1", "generic"])
def test_backup_then_prefetch_through_the_controller(make_storage, zero_copy: bool) -> None:
    pages = STORAGE_BATCH_SIZE + 22  # two storage batches
    pool = mha_host_pool("page_first", pages=2 * pages + 1)
    fill_random(pool, 7)
    storage = make_storage(pool)
    ctrl = controller_for(storage, pool, zero_copy=zero_copy)
    tokens = list(range(1000, 1000 + pages * pool.page_size))

    backup = StorageOperation(
        page_indices(pool, 0, pages),
        tokens,
        hash_value=get_storage_hash_str(tokens, None, page_size=pool.page_size),
    )
    ctrl._page_backup(backup)
    assert backup.completed_tokens == len(tokens)

    # a request sharing the first pages (more than one storage batch), then diverging
    shared = STORAGE_BATCH_SIZE + 12
    prompt = tokens[: shared * pool.page_size] + [7] * (3 * pool.page_size)
    prefetch = PrefetchOperation("req-1", prompt)
    hashes, hit_tokens = ctrl._storage_hit_query(prefetch)
    assert hit_tokens == shared * pool.page_size and len(hashes) == shared

    prefetch.hash_value = hashes
    prefetch.host_indices = page_indices(pool, pages, shared)
    assert ctrl._page_transfer(prefetch) == shared
    assert page_bytes(pool, pages, shared) == page_bytes(pool, 0, shared)
    # one progress report per storage batch, as the prefetch thread sees them
    acks = [ack.completed_tokens for ack in ctrl.prefetch_sync_queue.queue]
    assert acks == [STORAGE_BATCH_SIZE * pool.page_size, shared * pool.page_size]


def test_the_same_paths_hold_for_sglangs_own_file_backend(tmp_path) -> None:
    # the harness is not tailored to kvcore: SGLang's HiCacheFile passes it on its own path
    pool = mha_host_pool("page_first", pages=41)
    fill_random(pool, 8)
    config = storage_config({"file_storage_path": str(tmp_path)})
    hicache_file = create_storage("file", config)
    ctrl = controller_for(hicache_file, pool, zero_copy=False)
    tokens = list(range(20 * pool.page_size))
    backup = StorageOperation(
        page_indices(pool, 0, 20),
        tokens,
        hash_value=get_storage_hash_str(tokens, None, page_size=pool.page_size),
    )
    ctrl._page_backup(backup)
    prefetch = PrefetchOperation("req-2", tokens[: 12 * pool.page_size])
    hashes, hit_tokens = ctrl._storage_hit_query(prefetch)
    assert hit_tokens == 12 * pool.page_size
    prefetch.hash_value, prefetch.host_indices = hashes, page_indices(pool, 20, 12)
    assert ctrl._page_transfer(prefetch) == 12
    assert page_bytes(pool, 20, 12) == page_bytes(pool, 0, 12)
