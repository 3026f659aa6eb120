"""Functions the engine tests run inside an engine process (``{"op": "call"}`` steps)."""

from __future__ import annotations

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


def kill(pid: int) -> bool:
    """SIGKILL a process (a Mooncake master dying mid-run)."""
    os.kill(pid, signal.SIGKILL)
    return True


def remove_rank_objects(
    engine: Any, prompt: list[int], rank: int, from_block: int
) -> dict[str, Any]:
    """Remove one TP rank's objects of ``prompt``'s blocks from ``from_block`` on, through
    kvcore's ``Backend.remove`` on a backend opened as that rank (Mooncake: the cluster forgets
    them for every client at once)."""
    from kvcore_vllm.config import load_settings
    from kvcore_vllm.keys import engine_block_keys, engine_layout
    from kvcore_vllm.scheduler import backend_context, engine_world

    import kvcore

    config = engine.llm_engine.vllm_config
    settings = load_settings(config.kv_transfer_config.kv_connector_extra_config)
    context = backend_context(settings, engine_layout(config), rank, engine_world(config))
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
    """Overwrite every object of this process's opened ``memory`` backends with random bytes
    of the same size (so reads still succeed): restored KV is then garbage."""
    import random

    from kvcore_vllm import backends

    rng = random.Random(0)
    scrambled = 0
    with backends._registry_lock:
        opened = [entry[0] for entry in backends._registry.values()]
    for backend in opened:
        objects = getattr(backend.plugin, "_objects", None)
        if objects is None:
            continue
        for name, data in list(objects.items()):
            objects[name] = rng.randbytes(len(data))
            scrambled += 1
    return scrambled
