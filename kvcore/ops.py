"""Native swap ops that move KV-cache blocks between the engine's cache tensors and host memory.

Same call signatures as FastDeploy's ``swap_cache_all_layers`` / ``swap_cache_layout``. Cache
tensors may be Paddle or torch tensors (anything with ``data_ptr()``), CuPy arrays or numpy
arrays. CPU tensors go to the C++ extension ``kvcore._swap`` (or, in an install built without a
compiler, its Python twin :mod:`kvcore._swap_py`: see :mod:`kvcore.native`); GPU tensors go to
the optional CUDA library ``kvcore/_swap_cuda.so`` (built with ``KVCORE_CUDA=1`` or ``=auto``).

Modes: 0 copies device → host, 1 copies host → device. A destination id may appear only once per
call (duplicates raise ValueError: the result would depend on copy order); source ids may repeat.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcore.cuda_lib import cuda_available, require_cuda
from kvcore.host_memory import HostBuffer
from kvcore.native import swap_ops as _swap

__all__ = [
    "TO_DEVICE",
    "TO_HOST",
    "HostBuffer",
    "LayerSet",
    "copy_blocks",
    "copy_threads",
    "cuda_available",
    "describe_layers",
    "describe_tensor",
    "swap_cache_all_layers",
    "swap_cache_layout",
]

TO_HOST = 0
TO_DEVICE = 1


def copy_threads(num_threads: int | None, nbytes: int) -> int:
    """The threads a host copy of ``nbytes`` bytes uses when asked for ``num_threads`` (None
    or 0: kvcore's choice for that size), as the swap ops resolve it: what a benchmark's own
    threaded baseline should use to compare like with like.

    .. versionadded:: 0.3
    """
    return int(_swap.resolve_threads(num_threads or 0, nbytes))


# --------------------------------------------------------------------------- argument checks


def describe_tensor(t: Any, name: str) -> tuple[int, tuple[int, ...], int, bool]:
    """(address, shape, element size, on_gpu) of a contiguous tensor or array."""
    if isinstance(t, np.ndarray):
        if not t.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        return int(t.ctypes.data), tuple(t.shape), t.itemsize, False
    if hasattr(t, "data_ptr"):  # Paddle, torch: ask the framework, not its array interface
        if hasattr(t, "is_contiguous") and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        place = getattr(t, "place", None)
        if place is not None and hasattr(place, "is_gpu_place"):
            on_gpu = bool(place.is_gpu_place())
        else:
            on_gpu = bool(getattr(t, "is_cuda", False))
        return int(t.data_ptr()), tuple(int(s) for s in t.shape), int(t.element_size()), on_gpu
    # CuPy, Numba. (torch also offers this interface, but raises KeyError for dtypes it has no
    # type string for, float8 among them: hence the data_ptr branch first.)
    cai = getattr(t, "__cuda_array_interface__", None)
    if cai is not None:
        itemsize = np.dtype(cai["typestr"]).itemsize
        shape = tuple(int(s) for s in cai["shape"])
        contiguous_strides = tuple(itemsize * math.prod(shape[i + 1 :]) for i in range(len(shape)))
        if cai.get("strides") not in (None, contiguous_strides):
            raise ValueError(f"{name} must be C-contiguous")
        return int(cai["data"][0]), shape, itemsize, True
    raise TypeError(f"{name}: unsupported type {type(t).__name__}")


def _host_address(obj: Any, name: str) -> tuple[int, int | None]:
    """(address, size in bytes or None if unknown) of a host buffer given as int or object."""
    if isinstance(obj, HostBuffer):
        return obj.ptr, obj.nbytes
    if isinstance(obj, (int, np.integer)):
        if obj <= 0:
            raise ValueError(f"{name} must be a non-null address, got {obj}")
        return int(obj), None
    ptr, shape, itemsize, on_gpu = describe_tensor(obj, name)
    if on_gpu:
        raise ValueError(f"{name} must be host memory, got a GPU tensor")
    return ptr, math.prod(shape) * itemsize


def _ids(ids: Any, name: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D list of block ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class LayerSet:
    """One part's per-layer cache tensors, described once for the swap ops.

    The public ops describe their tensors on every call; an owner of long-lived tensors (the
    transfer manager's device cache) describes them once here and calls :func:`copy_layout` /
    :func:`copy_pairs`, which trust it. ``tensors`` keeps the memory alive.
    """

    tensors: tuple[Any, ...]
    ptrs: np.ndarray  # uint64, one address per layer
    nblocks: np.ndarray  # int64, blocks per layer
    block_shape: tuple[int, ...]
    itemsize: int
    on_gpu: bool

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.itemsize

    @property
    def nlayers(self) -> int:
        return len(self.tensors)


def describe_layers(cache_tensors: Sequence[Any], name: str = "cache_tensors") -> LayerSet:
    """Check that every layer shares block shape, element size and placement; describe them."""
    if len(cache_tensors) == 0:
        raise ValueError(f"{name} is empty")
    ptrs, nblocks = [], []
    block_shape: tuple[int, ...] | None = None
    itemsize = on_gpu = None
    for i, t in enumerate(cache_tensors):
        ptr, shape, size, gpu = describe_tensor(t, f"{name}[{i}]")
        if len(shape) < 2:
            raise ValueError(f"{name}[{i}] must be [num_blocks, ...], got shape {shape}")
        if block_shape is None:
            block_shape, itemsize, on_gpu = shape[1:], size, gpu
        elif shape[1:] != block_shape:
            raise ValueError(f"{name}[{i}] block shape {shape[1:]} != {block_shape}")
        elif size != itemsize:
            raise ValueError(f"{name}[{i}] element size {size} != {itemsize}")
        elif gpu != on_gpu:
            raise ValueError(f"{name} mix CPU and GPU tensors")
        ptrs.append(ptr)
        nblocks.append(shape[0])
    assert block_shape is not None and itemsize is not None and on_gpu is not None
    return LayerSet(
        tensors=tuple(cache_tensors),
        ptrs=np.asarray(ptrs, dtype=np.uint64),
        nblocks=np.asarray(nblocks, dtype=np.int64),
        block_shape=block_shape,
        itemsize=itemsize,
        on_gpu=on_gpu,
    )


def _id_pairs(
    device_block_ids: Sequence[int], other_ids: Sequence[int], other_name: str
) -> tuple[np.ndarray, np.ndarray]:
    """Both id lists as int64 arrays, checked to pair up."""
    dev_ids = _ids(device_block_ids, "device_block_ids")
    others = _ids(other_ids, other_name)
    if len(dev_ids) != len(others):
        raise ValueError(
            f"device_block_ids ({len(dev_ids)}) and {other_name} ({len(others)}) differ in length"
        )
    return dev_ids, others


def _check_mode(mode: int) -> int:
    if mode not in (TO_HOST, TO_DEVICE):
        raise ValueError(f"mode must be 0 (device->host) or 1 (host->device), got {mode}")
    return int(mode)


def _current_stream(sample: Any, device_id: int) -> int:
    """The framework's current CUDA stream for device_id, or 0 (legacy default stream)."""
    try:
        if hasattr(sample, "place"):
            import paddle

            stream = paddle.device.current_stream(f"gpu:{device_id}").stream_base
            # Paddle's stubs come from its CPU build, where CUDAStream has no cuda_stream
            return int(stream.cuda_stream)  # type: ignore[union-attr]
        if hasattr(sample, "is_cuda"):
            import torch

            return int(torch.cuda.current_stream(device_id).cuda_stream)
        if hasattr(sample, "__cuda_array_interface__"):
            import cupy

            return int(cupy.cuda.get_current_stream().ptr)
    except Exception:
        pass
    return 0


def _p(a: np.ndarray) -> int:
    return a.ctypes.data


# --------------------------------------------------------------------------- the ops


def copy_blocks(
    layers: LayerSet,
    host: np.ndarray | int,
    host_blocks: int,
    dev_ids: np.ndarray,
    host_ids: np.ndarray,
    device_id: int,
    mode: int,
    *,
    num_threads: int | None = None,
    stream: int | None = None,
) -> None:
    """Both swap ops on described layers and int64 id arrays (only the ids are checked, by the
    native code). ``host`` is an array of per-layer host addresses (``swap_cache_all_layers``:
    ``host_blocks`` blocks each) or one staging address (``swap_cache_layout``: ``host_blocks``
    slots, -1 when unknown)."""
    bb, per_layer = layers.block_bytes, isinstance(host, np.ndarray)
    if not layers.on_gpu:
        if isinstance(host, np.ndarray):  # per_layer, narrowing host for the type checker
            _swap.swap_all_layers(layers.ptrs, host, layers.nblocks, bb, host_blocks, dev_ids,
                                  host_ids, mode, num_threads or 0)  # fmt: skip
        else:
            _swap.swap_layout(layers.ptrs, layers.nblocks, bb, host, host_blocks, dev_ids,
                              host_ids, mode, num_threads or 0)  # fmt: skip
        return
    head: tuple[Any, ...]
    if per_layer:
        name, head = "kvc_cuda_swap_all_layers", (layers.ptrs, host, layers.nblocks)
    else:
        name, head = "kvc_cuda_swap_layout", (layers.ptrs, layers.nblocks)
    tail = (layers.nlayers, bb) if per_layer else (layers.nlayers, bb, host)
    _cuda(name, layers, device_id, stream, *head, *tail, host_blocks, dev_ids, host_ids, mode)


def _cuda(name: str, layers: LayerSet, device_id: int, stream: int | None, *args: Any) -> None:
    """Call a CUDA swap entry point: ``(device, stream, *args, n, mode, sync=1)`` where the last
    three of ``args`` are the two id arrays and the mode; arrays go as pointers."""
    *head, first_ids, second_ids, mode = args
    s = _current_stream(layers.tensors[0], device_id) if stream is None else stream
    pointers = [_p(a) if isinstance(a, np.ndarray) else a for a in head]
    require_cuda().call(name, int(device_id), s, *pointers, _p(first_ids), _p(second_ids),
                         len(first_ids), mode, 1)  # fmt: skip


def swap_cache_all_layers(
    cache_tensors: Sequence[Any],
    host_ptrs: Sequence[Any],
    max_host_blocks: int,
    device_block_ids: Sequence[int],
    host_block_ids: Sequence[int],
    device_id: int,
    mode: int,
    *,
    num_threads: int | None = None,
    stream: int | None = None,
) -> None:
    """Copy blocks between each layer's cache tensor and that layer's host buffer.

    host_ptrs[i] (int address, HostBuffer, numpy array or CPU tensor) holds max_host_blocks
    blocks laid out like cache_tensors[i]. Block device_block_ids[k] pairs with host block
    host_block_ids[k]; runs consecutive on both sides are copied at once. mode 0: device → host,
    1: host → device. num_threads (CPU path) defaults to KVCORE_SWAP_THREADS or min(4, cores);
    stream (GPU path) defaults to the framework's current stream. Returns after the copy is done.
    """
    mode = _check_mode(mode)
    layers = describe_layers(cache_tensors)
    if len(host_ptrs) != len(cache_tensors):
        raise ValueError(
            f"host_ptrs has {len(host_ptrs)} entries for {len(cache_tensors)} cache_tensors"
        )
    block_bytes = layers.block_bytes
    max_host_blocks = int(max_host_blocks)
    if max_host_blocks < 0:
        raise ValueError(f"max_host_blocks must be >= 0, got {max_host_blocks}")
    host = []
    for i, obj in enumerate(host_ptrs):
        ptr, size = _host_address(obj, f"host_ptrs[{i}]")
        if size is not None and size < max_host_blocks * block_bytes:
            raise ValueError(
                f"host_ptrs[{i}] holds {size} bytes < max_host_blocks * {block_bytes} bytes"
            )
        host.append(ptr)
    dev_ids, host_ids = _id_pairs(device_block_ids, host_block_ids, "host_block_ids")
    # The tensors and buffers stay referenced by the caller's frame and these locals until return.
    copy_blocks(
        layers,
        np.asarray(host, dtype=np.uint64),
        max_host_blocks,
        dev_ids,
        host_ids,
        device_id,
        mode,
        num_threads=num_threads,
        stream=stream,
    )


def swap_cache_layout(
    cache_tensors: Sequence[Any],
    staging_ptr: Any,
    cache_shape: Sequence[int],
    device_block_ids: Sequence[int],
    staging_slot_ids: Sequence[int],
    device_id: int,
    mode: int,
    *,
    staging_nslots: int | None = None,
    num_threads: int | None = None,
    stream: int | None = None,
) -> None:
    """Gather blocks of all layers into a [slot, layer, *block] staging buffer, or scatter back.

    cache_shape is [num_blocks, *block] of the main layers; every tensor must share the block
    shape, but its own num_blocks (extra layers may have fewer) bounds its ids. One slot is
    len(cache_tensors) blocks. mode 0 gathers (cache → staging), 1 scatters. staging_ptr may be
    an int address (slot ids then only checked against staging_nslots if given), a HostBuffer,
    a numpy array or a tensor (its size bounds the slot ids).
    """
    mode = _check_mode(mode)
    layers = describe_layers(cache_tensors)
    if len(cache_shape) < 2 or tuple(int(s) for s in cache_shape[1:]) != layers.block_shape:
        raise ValueError(
            f"cache_shape {list(cache_shape)} does not match cache tensors' block shape "
            f"{list(layers.block_shape)}"
        )
    slot_bytes = layers.block_bytes * layers.nlayers
    if isinstance(staging_ptr, (int, np.integer, HostBuffer, np.ndarray)) or not layers.on_gpu:
        staging, size = _host_address(staging_ptr, "staging_ptr")
    else:  # a device staging tensor is fine on the GPU path
        staging, shape, esize, _ = describe_tensor(staging_ptr, "staging_ptr")
        size = math.prod(shape) * esize
    nslots = -1 if size is None else size // slot_bytes
    if staging_nslots is not None:
        nslots = int(staging_nslots) if nslots < 0 else min(nslots, int(staging_nslots))
    dev_ids, slot_ids = _id_pairs(device_block_ids, staging_slot_ids, "staging_slot_ids")
    copy_blocks(
        layers,
        staging,
        nslots,
        dev_ids,
        slot_ids,
        device_id,
        mode,
        num_threads=num_threads,
        stream=stream,
    )
