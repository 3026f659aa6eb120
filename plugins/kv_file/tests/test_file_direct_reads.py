"""Objects the page cache does not hold are read with O_DIRECT, byte-exact and verified;
everything else (cached objects, unaligned buffers, direct reads off) reads through the cache."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import pytest
from kv_file.objfile import HEADER, PAGE
from kv_file.objio import memory_file_system
from kv_file_testutil import (
    LAYOUT,
    cache_first_page,
    cached_pages,
    direct_reads_work,
    drop_cached_pages,
    object_files,
    open_store,
    read,
    read_verified,
    write,
)

from kvcore.schemas import CacheLayout

#: every test here runs on both I/O paths: native (kvcore.fileio) and Python
pytestmark = pytest.mark.usefixtures("io_path")

KEYS = [f"d{i}" for i in range(6)]
PARTS = 2
#: objects of 129 pages: asked about by their first and last pages (LAYOUT's, of 17 pages,
#: are asked about whole)
LARGE = CacheLayout(num_layers=4, num_heads=8, block_size=64, head_dim=128)


@pytest.fixture
def root(tmp_path) -> str:
    if not direct_reads_work(str(tmp_path)):
        pytest.skip(f"{tmp_path}'s file system or kernel lacks O_DIRECT or cachestat(2)")
    return str(tmp_path / "s")


def _direct(store) -> int:
    return int(store.stats()["backend_direct_reads"])


def test_cold_objects_are_read_direct_and_verified(root) -> None:
    store = open_store(root)
    assert write(store, KEYS) == len(KEYS)
    assert read_verified(store, KEYS) == len(KEYS)
    assert _direct(store) == 0, "objects just written are cached: no direct reads"
    drop_cached_pages(object_files(root))
    _every_object_reads_direct(store)


def _partly_cached_store(root: str, layout: CacheLayout, leave: Callable[[str], None]):
    """A store of KEYS whose files the page cache holds only in part, as ``leave`` leaves
    each one."""
    store = open_store(root, layout)
    assert write(store, KEYS) == len(KEYS)
    for path in object_files(root):
        leave(path)
        assert 0 < cached_pages(path) < os.path.getsize(path) // PAGE
    return store


def _first_page_only(path: str) -> None:
    drop_cached_pages([path])
    cache_first_page(path)


def _all_but_the_last_pages(path: str) -> None:
    drop_cached_pages([path], os.path.getsize(path) - 2 * PAGE)


def _first_and_last_pages_only(path: str) -> None:
    _first_page_only(path)
    with open(path, "rb", buffering=0) as f:  # the last page too (no readahead: RANDOM)
        f.seek(os.path.getsize(path) - PAGE)
        f.read(PAGE)


@pytest.mark.parametrize("layout", [LAYOUT, LARGE], ids=["small", "large"])
def test_a_partly_cached_object_is_read_whole(root, layout: CacheLayout) -> None:
    _every_object_reads_direct(_partly_cached_store(root, layout, _first_page_only))


@pytest.mark.parametrize("layout", [LAYOUT, LARGE], ids=["small", "large"])
def test_an_object_that_lost_its_last_pages_is_read_direct(root, layout: CacheLayout) -> None:
    _every_object_reads_direct(_partly_cached_store(root, layout, _all_but_the_last_pages))


def test_a_large_object_missing_only_middle_pages_reads_through_the_cache(root) -> None:
    """Its first and last pages are what is asked (a file leaves the cache oldest pages
    first): one with a hole in the middle reads buffered, the same bytes."""
    store = _partly_cached_store(root, LARGE, _first_and_last_pages_only)
    assert read_verified(store, KEYS) == len(KEYS)
    assert _direct(store) == 0
    store.close()


def _every_object_reads_direct(store) -> None:
    assert read_verified(store, KEYS) == len(KEYS)
    assert _direct(store) == len(KEYS) * PARTS
    store.close()


def test_unaligned_buffers_read_through_the_cache(root) -> None:
    store = open_store(root)
    assert write(store, KEYS) == len(KEYS)
    drop_cached_pages(object_files(root))
    assert read_verified(store, KEYS, offset=16) == len(KEYS)
    assert _direct(store) == 0
    store.close()


def test_direct_reads_can_be_turned_off(root) -> None:
    store = open_store(root, direct_reads=False)
    assert write(store, KEYS) == len(KEYS)
    drop_cached_pages(object_files(root))
    assert read_verified(store, KEYS) == len(KEYS)
    assert _direct(store) == 0
    store.close()


def test_env_override_turns_direct_reads_off(root, monkeypatch) -> None:
    monkeypatch.setenv("KVCORE_FILE_DIRECT_READS", "false")
    store = open_store(root)
    assert store.plugin.config.direct_reads is False
    store.close()


@pytest.mark.parametrize(
    "damage", ["payload_bit", "truncate", "magic", "name_bit", "zeroed_header"]
)
def test_a_damaged_cold_object_is_removed_and_heals(root, damage: str) -> None:
    # header damage keeps the file's size, so only the direct read itself can find it: the
    # recheck must not read the O_DIRECT descriptor into an unaligned buffer (EINVAL)
    store = open_store(root)
    assert write(store, KEYS[:3]) == 3
    before = set(object_files(root))
    assert write(store, KEYS[3:4]) == 1
    (path,) = sorted(set(object_files(root)) - before)[:1]
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(size - PAGE)
        elif damage == "zeroed_header":  # what a power loss can leave
            f.write(bytes(PAGE))
        else:
            offset = {"payload_bit": size - 100, "magic": 0, "name_bit": HEADER.size + 3}[damage]
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 1]))
    drop_cached_pages(object_files(root))
    done, _ = read(store, KEYS[:4])
    assert done == 3
    assert not os.path.exists(path)
    assert store.stats()["backend_corrupt_removed"] == 1
    assert store.stats().get("backend_io_errors", 0) == 0
    assert write(store, KEYS[:4]) == 4, "the block is written again, not skipped"
    drop_cached_pages(object_files(root))
    assert read_verified(store, KEYS[:4]) == 4
    store.close()


def test_reads_from_disk_use_every_io_thread_cached_ones_one_per_core(root) -> None:
    store = open_store(root, io_threads=12)
    plugin = store.plugin
    assert write(store, KEYS) == len(KEYS)
    req = store.request("r", KEYS)
    assert plugin._transfers._read_workers(req) == min(12, plugin._cpus)
    drop_cached_pages(object_files(root))
    assert plugin._transfers._read_workers(req) == 12
    store.close()


def test_a_store_in_memory_reads_through_the_cache_without_asking() -> None:
    """A store on tmpfs: its files are memory, so there is nothing to go around, and no read
    asks ``cachestat`` whether its object is cached (measured: 0.6 µs of 7 per 64 KiB object)."""
    shm = "/dev/shm"
    if memory_file_system(shm) is None:
        pytest.skip(f"{shm} is not a memory-backed file system here")
    with tempfile.TemporaryDirectory(dir=shm) as work:
        store = open_store(os.path.join(work, "s"))
        assert not store.plugin._direct.enabled
        assert write(store, KEYS) == len(KEYS)
        assert read_verified(store, KEYS) == len(KEYS)
        assert _direct(store) == 0
        store.close()


def test_only_memory_backed_file_systems_are_named(tmp_path) -> None:
    expected = {"tmpfs", "ramfs", None}
    assert memory_file_system(str(tmp_path)) in expected
    assert memory_file_system(str(tmp_path / "absent")) is None  # cannot tell: not memory
    if os.path.isdir("/proc/self"):
        assert memory_file_system("/proc/self") is None  # procfs: a file system, not memory
