"""Run SGLang's real storage layer on a CPU-only machine: for this package's tests and benchmark.

- :func:`prepare_cpu_sglang` lets ``import sglang`` succeed with a CPU build of torch;
- :func:`mha_host_pool`, :func:`mla_host_pool`, :func:`mamba_host_pool` build SGLang's own host
  pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``, ``MambaPoolHost``) over CPU
  tensors, exactly as SGLang's pool assembler would from device-pool buffer infos;
- :func:`storage_config` and :func:`create_storage` go through SGLang's
  ``HiCacheStorageConfig`` and ``StorageBackendFactory``.

Nothing here stands in for SGLang code: every class used is SGLang's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "controller_for",
    "create_storage",
    "extra_config",
    "fill_random",
    "mamba_host_pool",
    "mha_host_pool",
    "mla_host_pool",
    "prepare_cpu_sglang",
    "storage_config",
]

_BUDGET = 1 << 50  # host pools here are small; do not let SGLang size them against free RAM


def prepare_cpu_sglang() -> None:
    """Make ``import sglang`` work with torch's CPU build. Call before importing SGLang.

    SGLang imports torchvision, whose only wheel on the package registry is built against
    torch's CUDA libraries: with CPU torch its native ops do not load, and its import then
    fails registering fake kernels for two of them (``torchvision::nms``/``qnms``), the only
    registrations it does not guard. Declaring those two operator schemas first lets the
    pure-Python part import (SGLang's storage layer uses none of torchvision's ops). Does
    nothing when torchvision's native library loads, or torchvision is absent or imported.
    """
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None or "torchvision" in sys.modules:
        return
    native = Path(spec.origin).with_name("_C.so")
    try:
        torch.ops.load_library(str(native))
        return
    except (OSError, RuntimeError):
        pass
    for op in ("nms", "qnms"):
        with contextlib.suppress(RuntimeError):  # already defined by an earlier call
            torch.library.define(
                f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
            )


def _cpu_ptrs(tensors: Any) -> Any:
    import torch

    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_host_pool(
    layout: str = "page_first",
    *,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 16,
    page_size: int = 16,
    pages: int = 32,
    dtype: Any = None,
) -> Any:
    """SGLang's ``MHATokenToKVPoolHost`` over CPU memory, ``pages`` pages of ``page_size``."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dtype = dtype or torch.bfloat16
    # the device pool only describes geometry here: one page per layer is enough
    k = tuple(torch.zeros(page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=_cpu_ptrs(k), v_data_ptrs=_cpu_ptrs(v), layout=KVBufferLayout.NHD
        ),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return _cpu_host_pool(MHATokenToKVPoolHost, info, layout, page_size, pages, layers)


def _cpu_host_pool(
    pool_class: Any, info: Any, layout: str, page_size: int, pages: int, layers: int, **extra: Any
) -> Any:
    """One of SGLang's host pool classes over CPU memory, unpinned, ``pages`` pages deep."""
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    with host_memory_budget_scope(_BUDGET):
        return pool_class(
            info,
            1.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=page_size,
            start_layer=0,
            end_layer=layers,
            host_token_capacity=pages * page_size,
            **extra,
        )


def mla_host_pool(
    layout: str = "page_first",
    *,
    layers: int = 2,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    page_size: int = 16,
    pages: int = 32,
    dtype: Any = None,
) -> Any:
    """SGLang's ``MLATokenToKVPoolHost`` over CPU memory (one latent row per token and layer)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = dtype or torch.bfloat16
    width = kv_lora_rank + rope_dim
    rows = tuple(torch.zeros(page_size, 1, width, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=rows,
        data_ptrs=_cpu_ptrs(rows),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_size,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        kv_cache_dim=width,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return _cpu_host_pool(
        MLATokenToKVPoolHost, info, layout, page_size, pages, layers, target_layer_num=layers
    )


def mamba_host_pool(*, layers: int = 2, slots: int = 16, layout: str = "page_first") -> Any:
    """SGLang's ``MambaPoolHost`` (one state slot per page: temporal + one conv state)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, 4, 3, 8, dtype=torch.float32),
        conv=(torch.zeros(layers, 4, 6, 2, dtype=torch.bfloat16),),
    )
    with host_memory_budget_scope(_BUDGET):
        pool = MambaPoolHost(
            info,
            float(slots) / 4,
            0,
            device_capacity=4,
            pin_memory=False,
            device="cpu",
            layout=layout,
        )
    return pool


def fill_random(pool: Any, seed: int = 0) -> None:
    """Fill every byte of the pool's host memory with seeded random bytes."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    buffers = [pool.kv_buffer] if isinstance(pool.kv_buffer, torch.Tensor) else []
    if not buffers and hasattr(pool, "get_hybrid_pool_buffer"):
        buffers = list(pool.get_hybrid_pool_buffer())
    for buf in buffers:
        raw = buf.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def extra_config(backend: str, backend_config: Any = None, **more: Any) -> dict[str, Any]:
    """SGLang's ``dynamic`` extra config selecting kvcore with ``backend``."""
    from kvcore_sglang import EXTRA_CONFIG

    out = {**EXTRA_CONFIG, "backend": backend, **more}
    if backend_config is not None:
        out["backend_config"] = backend_config
    return out


def storage_config(
    extra: dict[str, Any] | None = None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    is_mla: bool = False,
    page_first: bool = True,
    model_name: str | None = "test/model",
    metrics: bool = False,
    **fields: Any,
) -> Any:
    """SGLang's ``HiCacheStorageConfig`` for one rank."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=page_first,
        model_name=model_name,
        extra_config=dict(extra) if extra is not None else None,
        **fields,
    )


def create_storage(backend_name: str, config: Any, pool: Any | None = None) -> Any:
    """Build a storage through SGLang's ``StorageBackendFactory`` and register ``pool``, the
    way ``HiCacheController.attach_storage_backend`` does."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    storage = StorageBackendFactory.create_backend(backend_name, config, pool)
    if pool is not None:
        storage.register_mem_pool_host(pool)
    return storage


def controller_for(storage: Any, pool: Any, *, zero_copy: bool) -> Any:
    """SGLang's ``HiCacheController``, set up for its storage-thread methods only.

    Its constructor needs a GPU device pool, so it is bypassed; ``_page_backup``,
    ``_storage_hit_query`` and ``_page_transfer`` read only the attributes set here, which are
    the ones ``attach_storage_backend`` sets, including its choice of page functions: the
    zero-copy pair (``batch_get_v1``/``batch_set_v1``) for its own zero-copy backends and for
    ``dynamic`` with ``interface_v1``, the generic pair (flat page copies through
    ``batch_get``/``batch_set``) for every other backend, HiCacheFile included.
    """
    import queue

    from sglang.srt.managers.cache_controller import HiCacheController

    ctrl = HiCacheController.__new__(HiCacheController)
    ctrl.storage_backend = storage
    ctrl.storage_config = storage.storage_config if hasattr(storage, "storage_config") else None
    ctrl.mem_pool_host = ctrl.storage_host_pool = pool
    ctrl.page_size = pool.page_size
    ctrl.prefetch_sync_queue = queue.Queue()
    if zero_copy:
        ctrl.page_get_func, ctrl.page_set_func = ctrl._page_get_zero_copy, ctrl._page_set_zero_copy
    else:
        ctrl.page_get_func, ctrl.page_set_func = ctrl._generic_page_get, ctrl._generic_page_set
    return ctrl
