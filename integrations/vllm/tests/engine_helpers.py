"""Functions the engine tests run inside an engine process (``{"op": "call"}`` steps)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any


def flip_bit_in_file_store(engine: Any, root: str, prompt: list[int], block: int) -> str:
    """Flip one payload bit of the ``k`` object kv_file holds for ``prompt``'s block ``block``.

    The object is found by its name, computed the way the engine's connector computes it, so
    this also checks that names are reproducible from the engine's config alone.
    """
    from kv_file.objfile import encode_name, header_size
    from kv_file.paths import name_digest
    from kvcore_vllm.keys import engine_object_names

    name = engine_object_names(engine.llm_engine.vllm_config, prompt)[block][0]
    filename = f"{name_digest(encode_name(name)):032x}.kv"
    matches = list(Path(root).rglob(filename))
    assert len(matches) == 1, f"expected one file for {name!r} under {root}, found {matches}"
    path = matches[0]
    offset = header_size(len(encode_name(name))) + 100  # inside the payload
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    return str(path)


def _opened_backends() -> list[Any]:
    """The kvcore backends the connector opened in this process (shared handles)."""
    from kvcore.handles import opened_backends

    return list(opened_backends())


def flip_bit_in_store(engine: Any, prompt: list[int], block: int) -> str:
    """Flip one payload bit of the ``k`` object of ``prompt``'s block ``block`` in the store
    the connector opened here (memory: its dict; Mooncake: the cluster, through this
    process's client), as a failing store's memory would. The backend itself keeps no
    checksum: kvcore's block digests are what must catch it."""
    from kvcore_vllm.keys import engine_object_names

    name = engine_object_names(engine.llm_engine.vllm_config, prompt)[block][0]
    for backend in _opened_backends():
        objects = getattr(backend.plugin, "_objects", None)
        if isinstance(objects, dict) and name in objects:
            data = bytearray(objects[name])
            data[100] ^= 0x10
            objects[name] = bytes(data)
            return f"memory:{name}"
        if backend.name == "mooncake":
            from kv_mooncake.store_keys import store_key

            store = backend.plugin.store
            key = store_key(name, backend.context.namespace)
            data = bytearray(store.get(key))
            assert data, f"no Mooncake object {key!r}"
            data[100] ^= 0x10
            assert store.upsert(key, bytes(data)) == 0, "the Mooncake upsert failed"
            assert store.get(key) == bytes(data), "the Mooncake object did not change"
            return f"mooncake:{key}"
    raise AssertionError(f"no opened backend holds {name!r}")


def kill(pid: int) -> bool:
    """SIGKILL a process (a Mooncake master dying mid-run)."""
    os.kill(pid, signal.SIGKILL)
    return True


def abort_while_loading(engine: Any, prompt: list[int], store_root: str) -> dict[str, Any]:
    """Submit ``prompt`` to an in-process engine whose connector loads in the background,
    abort it right after the step that started its load, and run the engine until it is idle.

    Returns how many of the connector's background reads were still running when the abort
    was made (the case this checks: a load in flight when vLLM drops its request) and how
    many steps the engine took to let the request go."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    evict_from_page_cache(store_root)  # the reads go to the disk: they take a while
    worker = get_kv_transfer_group().worker_side
    assert worker is not None, "an in-process engine's worker connector"
    llm_engine = engine.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    llm_engine.add_request("abort-while-loading", {"prompt_token_ids": prompt}, params)
    llm_engine.step()  # looked up, blocks allocated, the load started
    with worker._lock:
        running = sum(
            1
            for _, runs in worker._loading.values()
            for _, futures in runs
            for fut in futures
            if fut is not None and not fut.done()
        )
    llm_engine.abort_request(["abort-while-loading"])
    steps = 0
    while llm_engine.has_unfinished_requests() and steps < 1000:
        llm_engine.step()
        steps += 1
    return {"reads_running_at_abort": running, "steps_after_abort": steps}


def evict_from_page_cache(root: str) -> int:
    """Drop every regular file under ``root`` from the page cache (no privileges needed)."""
    count = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    count += 1
                finally:
                    os.close(fd)
    return count


def mooncake_mounted_bytes(engine: Any, metrics_port: int) -> int:
    """The memory every Mooncake client has mounted into the store, as the master counts it
    (asked while ``engine``'s processes, the scheduler's included, hold their clients)."""
    from kv_mooncake.testing import MooncakeMaster

    master = MooncakeMaster()
    master.metrics_port = metrics_port
    return master.capacity_bytes()


def remove_rank_objects(
    engine: Any, prompt: list[int], rank: int, from_block: int
) -> dict[str, Any]:
    """Remove one TP rank's objects of ``prompt``'s blocks from ``from_block`` on, through
    kvcore's ``Backend.remove`` on a backend opened as that rank (Mooncake: the cluster forgets
    them for every client at once)."""
    from kvcore_vllm.config import load_settings
    from kvcore_vllm.context import backend_context
    from kvcore_vllm.keys import engine_block_keys, engine_layout, engine_slice_plan

    import kvcore

    config = engine.llm_engine.vllm_config
    settings = load_settings(config.kv_transfer_config.kv_connector_extra_config)
    world = engine_slice_plan(config).world
    context = backend_context(settings, engine_layout(config), rank, world)
    keys = engine_block_keys(config, prompt)
    backend = kvcore.open_backend(settings.backend, settings.backend_config, context=context)
    try:
        removed = backend.remove(
            backend.request("test/remove", keys[from_block:], start_block=from_block)
        )
    finally:
        backend.close()
    return {"removed": int(removed), "failure": getattr(removed, "failure", None)}


def scramble_memory_store() -> int:
    """A consistent liar: overwrite every K and V object of this process's opened ``memory``
    backends with random bytes of the same size and store matching block digests, so reads
    succeed and pass kvcore's digest check: restored KV is then garbage. (This is what the
    checks of the tokens must catch; a liar that leaves the digests alone is caught by them.)"""
    import random

    import xxhash

    from kvcore.transfer.integrity import DIGEST_PART

    rng = random.Random(0)
    scrambled = 0
    for backend in _opened_backends():
        objects = getattr(backend.plugin, "_objects", None)
        if not isinstance(objects, dict):  # not the memory backend
            continue
        parts = backend.context.layout.parts
        for name in [n for n in objects if f"/{DIGEST_PART}/" in n]:
            head, tail = name.split(f"/{DIGEST_PART}/")
            digests = []
            for part in parts:
                part_name = f"{head}/{part}/{tail}"
                objects[part_name] = rng.randbytes(len(objects[part_name]))
                digests.append(xxhash.xxh3_128(objects[part_name]).digest())
                scrambled += 1
            objects[name] = b"".join(digests)
    return scrambled


def _store_backend(engine: Any, rank: int = 0) -> Any:
    """The connector's backend opened afresh in this process, as rank ``rank``."""
    from kvcore_vllm.config import load_settings
    from kvcore_vllm.context import backend_context
    from kvcore_vllm.keys import engine_layout, engine_slice_plan

    import kvcore

    config = engine.llm_engine.vllm_config
    settings = load_settings(config.kv_transfer_config.kv_connector_extra_config)
    world = engine_slice_plan(config).world
    context = backend_context(settings, engine_layout(config), rank, world)
    return kvcore.open_backend(settings.backend, settings.backend_config, context=context)


def blocks_in_store(engine: Any, prompt: list[int]) -> dict[str, Any]:
    """For each full block of ``prompt``: whether the store holds it (every part), and when
    this was asked (wall clock, to compare with the time stamps of vLLM's event batches)."""
    import time

    from kvcore_vllm.keys import engine_block_keys

    keys = engine_block_keys(engine.llm_engine.vllm_config, prompt)
    backend = _store_backend(engine)
    try:
        held = [bool(backend.query(backend.request("test/probe", [k]))) for k in keys]
    finally:
        backend.close()
    return {"held": held, "at": time.time()}


def blocks_by_rank_name(engine: Any, prompt: list[int]) -> dict[str, int]:
    """How many of ``prompt``'s full blocks the store holds (every part) under each object
    naming ``r<rank>of<world>`` of world 1 and 2: which ranks' names an engine wrote."""
    from kvcore_vllm.config import load_settings
    from kvcore_vllm.context import backend_context
    from kvcore_vllm.keys import engine_block_keys, engine_layout

    import kvcore

    config = engine.llm_engine.vllm_config
    settings = load_settings(config.kv_transfer_config.kv_connector_extra_config)
    keys = engine_block_keys(config, prompt)
    held = {}
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        context = backend_context(settings, engine_layout(config), rank, world)
        backend = kvcore.open_backend(settings.backend, settings.backend_config, context=context)
        try:
            held[f"r{rank}of{world}"] = int(backend.query(backend.request("test/probe", keys)))
        finally:
            backend.close()
    return held


def clear_store(engine: Any) -> int:
    """Clear the connector's namespace through a backend this helper opens (as an operator's
    ``kvcore`` tool would, beside the engine)."""
    backend = _store_backend(engine)
    try:
        return int(backend.clear())
    finally:
        backend.close()


def now() -> float:
    """The wall clock (to compare with the time stamps of vLLM's event batches)."""
    import time

    return time.time()


def flip_last_byte_of_every_object(engine: Any, root: str) -> int:
    """Flip a payload bit of each kv_file object under ``root`` (an object's last byte is
    payload): every lookup still finds the blocks, every load fails its check."""
    files = list(Path(root).rglob("*.kv"))
    for path in files:
        with open(path, "r+b") as f:
            f.seek(-1, 2)
            byte = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([byte[0] ^ 0x10]))
    return len(files)


def touch(path: str) -> float:
    """Create ``path`` (a signal to another engine's steps, or to the test); the wall clock."""
    import time

    Path(path).touch()
    return time.time()


def wait_for_file(path: str, timeout_s: float = 300.0) -> float:
    """Wait (idle: the engine does not step) until ``path`` exists; the wall clock then."""
    import time

    deadline = time.monotonic() + timeout_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)
    return time.time()
