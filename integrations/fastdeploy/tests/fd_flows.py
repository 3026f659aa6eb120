"""A replay of FastDeploy's storage flows, on Paddle CPU tensors, against a storage object.

FastDeploy's cache transfer manager (``cache_transfer_manager.py`` at
PaddlePaddle/FastDeploy@1af00818db85f4e844327e9ba5ccfacff1afe9bf) cannot run here: it needs
CUDA custom ops and its engine's IPC queues. What it does with a key-value storage backend is
small and is reproduced step by step below, with FastDeploy's names, staging buffers and call
arguments, so the adapter is driven exactly as the patched transfer manager would drive it:

- read (``read_storage_task``/``_run_read_storage``, lines 764-843 and 632-762): name the
  task's blocks, ``query`` the leading run, ``batch_get`` it into the read staging buffer (one
  slot per block, K objects then V objects then the scales), count the leading blocks whose
  objects all answered ``> 0``, and scatter those from staging into the cache
  (``swap_cache_layout`` mode 1);
- write-back (``write_back_storage_task``/``_run_write_back_storage``, lines 989-1061 and
  845-959): ``query`` the stored prefix, skip it, gather the rest from the cache into the
  write staging buffer (mode 0), ``batch_set`` it;
- flush-only (``FD_AS_ONLY_FLUSH``, lines 961-987 and 997-998): the write-back task only
  reports; for a key-value backend it touches no storage at all.

The device<->staging copies use kvcore's native ``swap_cache_layout``, which has FastDeploy's
signature and staging layout (``[slot, layer, head, block, dim]``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle

import kvcore
from kvcore.ops import TO_DEVICE, TO_HOST, HostBuffer, swap_cache_layout

_PADDLE_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "uint8": "uint8"}


@dataclass
class ReadResult:
    matched: int  # what query answered
    restored: list[int]  # device block ids FastDeploy reports as restored
    answers: list[int] = field(default_factory=list)  # batch_get's per-key answers


@dataclass
class WriteResult:
    matched: int
    written: list[int]  # device block ids FastDeploy reports as written
    answers: list[int] = field(default_factory=list)  # batch_set's per-key answers
    storage_calls: int = 0


class FastDeployRank:
    """One rank's cache (Paddle tensors) and storage staging, driving FastDeploy's flows."""

    def __init__(
        self,
        storage: Any,
        layout: kvcore.CacheLayout,
        *,
        rank: int = 0,
        key_prefix: str = "",
        max_blocks_per_task: int = 16,
        as_only_flush: bool = False,
        timeout: float = 5.0,
    ) -> None:
        self.storage = storage
        self.layout = layout
        self.rank = rank
        self.key_prefix = key_prefix
        self.as_only_flush = as_only_flush
        self.timeout = timeout
        self.has_scales = layout.dtype.has_scales
        cache_dtype = "uint8" if self.has_scales else _PADDLE_DTYPES[layout.dtype.value]
        shape = list(layout.kv_shape)
        self.k_caches = [paddle.zeros(shape, dtype=cache_dtype) for _ in range(layout.total_layers)]
        self.v_caches = [paddle.zeros(shape, dtype=cache_dtype) for _ in range(layout.total_layers)]
        self.cache_shape = shape
        if self.has_scales:
            scale_shape = list(layout.scale_shape)
            self.scale_shape = scale_shape
            sdt = layout.scale_dtype
            self.k_scales = [paddle.zeros(scale_shape, dtype=sdt) for _ in self.k_caches]
            self.v_scales = [paddle.zeros(scale_shape, dtype=sdt) for _ in self.k_caches]
        # _init_storage_buffer: one read and one write buffer, K half then V half, registered
        self.slots = max_blocks_per_task
        self.stride = layout.part_bytes("k")
        self.read_buf = self._staging(self.stride)
        self.write_buf = self._staging(self.stride)
        if self.has_scales:
            self.scale_stride = layout.part_bytes("k_scale")
            self.scale_read_buf = self._staging(self.scale_stride)
            self.scale_write_buf = self._staging(self.scale_stride)

    # -- the cache --------------------------------------------------------------------------

    def fill(self, block_ids: list[int], seed: int) -> None:
        """Random bytes in the given device blocks of every layer and part."""
        rng = np.random.default_rng(seed)
        for t in self._tensors():
            view = _bytes(t)
            for b in block_ids:
                view[b] = rng.integers(0, 256, view[b].shape, dtype=np.uint8)

    def block_bytes(self, block_id: int) -> list[bytes]:
        """Every layer's and part's bytes of one device block."""
        return [_bytes(t)[block_id].tobytes() for t in self._tensors()]

    def names(self, hashes: list[str]) -> dict[str, list[str]]:
        """read_storage_task's names (lines 773-780)."""
        pre = f"prefix{self.key_prefix}"
        out = {
            "k": [f"{pre}_{h}_{self.rank}_key" for h in hashes],
            "v": [f"{pre}_{h}_{self.rank}_value" for h in hashes],
        }
        if self.has_scales:
            out["k_scale"] = [f"{pre}_{h}_{self.rank}_key_scale" for h in hashes]
            out["v_scale"] = [f"{pre}_{h}_{self.rank}_value_scale" for h in hashes]
        return out

    # -- the flows --------------------------------------------------------------------------

    def read(self, hashes: list[str], gpu_block_ids: list[int]) -> ReadResult:
        names = self.names(hashes)
        cpu_ids = list(range(len(gpu_block_ids)))
        matched = self.storage.query(
            names["k"], names["v"], names.get("k_scale"), names.get("v_scale"), self.timeout
        )
        names = {p: keys[:matched] for p, keys in names.items()}
        gpu_block_ids, cpu_ids = gpu_block_ids[:matched], cpu_ids[:matched]
        if matched == 0:
            return ReadResult(0, [])
        keys, locations, sizes = self._batch(names, cpu_ids, write=False)
        answers = self.storage.batch_get(keys=keys, target_locations=locations, target_sizes=sizes)
        runs = [answers[j * matched : (j + 1) * matched] for j in range(len(names))]
        ok = 0
        for objects in zip(*runs, strict=True):
            if not all(a > 0 for a in objects):
                break
            ok += 1
        self._swap(gpu_block_ids[:ok], cpu_ids[:ok], TO_DEVICE)
        return ReadResult(matched, gpu_block_ids[:ok], answers)

    def write_back(self, hashes: list[str], gpu_block_ids: list[int]) -> WriteResult:
        if self.as_only_flush:
            # _flush_only_storage_task: only an AttentionStore gets a call; this reports []
            return WriteResult(0, [])
        names = self.names(hashes)
        cpu_ids = list(range(len(gpu_block_ids)))
        matched = self.storage.query(
            names["k"], names["v"], names.get("k_scale"), names.get("v_scale"), self.timeout
        )
        if matched >= len(hashes):
            return WriteResult(matched, [], storage_calls=1)
        names = {p: keys[matched:] for p, keys in names.items()}
        gpu_block_ids, cpu_ids = gpu_block_ids[matched:], cpu_ids[matched:]
        self._swap(gpu_block_ids, cpu_ids, TO_HOST)
        keys, locations, sizes = self._batch(names, cpu_ids, write=True)
        answers = self.storage.batch_set(keys=keys, target_locations=locations, target_sizes=sizes)
        # FastDeploy reports every block it handed to batch_set (it ignores the answers)
        return WriteResult(matched, gpu_block_ids, answers, storage_calls=2)

    # -- internals --------------------------------------------------------------------------

    def _tensors(self) -> list[Any]:
        tensors = [*self.k_caches, *self.v_caches]
        if self.has_scales:
            tensors += [*self.k_scales, *self.v_scales]
        return tensors

    def _staging(self, stride: int) -> HostBuffer:
        buf = HostBuffer(self.slots * stride * 2, pinned=False)
        self.storage.register_buffer(buf.ptr, buf.nbytes)
        return buf

    def _batch(
        self, names: dict[str, list[str]], cpu_ids: list[int], *, write: bool
    ) -> tuple[list[str], list[int], list[int]]:
        """Keys K then V (then scales), each pointing at its slot of the staging buffer."""
        kv = self.write_buf if write else self.read_buf
        regions = [(kv.ptr, self.stride), (kv.ptr + kv.nbytes // 2, self.stride)]
        if self.has_scales:
            sc = self.scale_write_buf if write else self.scale_read_buf
            regions += [(sc.ptr, self.scale_stride), (sc.ptr + sc.nbytes // 2, self.scale_stride)]
        keys: list[str] = []
        locations: list[int] = []
        sizes: list[int] = []
        for part_keys, (base, stride) in zip(names.values(), regions, strict=True):
            keys += part_keys
            locations += [base + i * stride for i in cpu_ids]
            sizes += [stride] * len(cpu_ids)
        return keys, locations, sizes

    def _swap(self, gpu_ids: list[int], cpu_ids: list[int], mode: int) -> None:
        if not gpu_ids:
            return
        kv = self.read_buf if mode == TO_DEVICE else self.write_buf
        half = kv.nbytes // 2
        pairs = [
            (self.k_caches, kv.ptr, self.cache_shape),
            (self.v_caches, kv.ptr + half, self.cache_shape),
        ]
        if self.has_scales:
            sc = self.scale_read_buf if mode == TO_DEVICE else self.scale_write_buf
            pairs += [
                (self.k_scales, sc.ptr, self.scale_shape),
                (self.v_scales, sc.ptr + sc.nbytes // 2, self.scale_shape),
            ]
        for tensors, staging, shape in pairs:
            swap_cache_layout(
                tensors, staging, shape, gpu_ids, cpu_ids, 0, mode, staging_nslots=self.slots
            )


def _bytes(tensor: Any) -> np.ndarray:
    """A writable uint8 view of a Paddle tensor, blocks along the first axis (no copy)."""
    arr = np.from_dlpack(tensor.view(paddle.uint8) if tensor.dtype != paddle.uint8 else tensor)
    return arr.reshape(arr.shape[0], -1)


def raw_bytes(ptr: int, nbytes: int) -> bytes:
    return ctypes.string_at(ptr, nbytes)
