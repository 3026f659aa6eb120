# REFERENCE IMPLEMENTATION of the attentionstore_sdk surface FastDeploy calls (not the vendor SDK).
"""``AttentionStoreSDK`` and ``Tokens`` with exactly the signatures FastDeploy calls.

Where each signature was read (FD = PaddlePaddle/FastDeploy@1af00818db85f4e844327e9ba5ccfacff1afe9bf,
fastdeploy/cache_manager/transfer_factory/mooncake_store/attention_store.py):

- ``Tokens(token_ids, block_token_size)``: FD lines 121, 149, 195, 237, 252.
- ``AttentionStoreSDK(namespace, pod_name, model_version, shard_id, shard_num, layer_num,
  block_token_size, k_bytes, v_bytes, device_id, dp_id, attention_type=, enable_as_kv_rw=,
  gpu_count=)``: FD lines 80-95 (FastDeploy's CUDA branch).
- ``PerBlockBytesAttentionStoreSDK``, the older constructor ``(..., block_token_size,
  bytes_per_shard_layer_per_block, device_id, dp_id)``: FD lines 97-108 (non-CUDA branch) and
  seed 002 (FastDeploy PR #5823). Tests install it as ``sdk.AttentionStoreSDK`` to play an SDK
  of that generation (which also lacks ``client.client``).
- ``match(tokens, start_block_idx, timeout) -> int``: FD lines 122 (readiness probe) and 240.
- ``read(layer_ids, tokens, start_block_idx, k_ptrs, v_ptrs, gpu_block_ids, timeout) -> int``:
  FD lines 166-174; the K/V-constructor SDK is also passed ``remote_addrs=None`` (lines 155-164).
- ``write(...same...) -> int``: FD lines 213-221; the K/V-constructor SDK is also passed
  ``h2h_copy=False, params=None`` (lines 201-211). FastDeploy PR #7614 (merged 2026-04) cuts
  writes into slices (``AS_WRITE_SLICE_BLOCK_NUM``/``AS_WRITE_SLICE_TIMEOUT``); the call is the
  same.
- ``flush_token_index(layer_ids, tokens, start_block_idx, <medium>, <medium>)``: FD lines
  253-268: five positional arguments and no timeout; ``(None, MEDIA_HBM)`` when the blocks now
  live in device memory, ``(MEDIA_HBM, None)`` when they left it. FastDeploy ignores its
  answer; this reference answers None, the least a caller can count on.

Parameter names are the reference's own: FastDeploy passes every argument above positionally
except the keyword ones, so the vendor's names are unknown. Keyword arguments FastDeploy passes
are required keywords here, so a caller that omits one fails as it might on the vendor's SDK.

Behaviour (what the tests rely on): a block is named by the hash of every token from the root
through its last token, so equal names mean equal prefixes; only full blocks of a ``Tokens``
have names. ``match`` counts consecutive stored blocks from ``start_block_idx``. ``read`` and
``write`` copy each listed layer's block ``b`` at ``k_ptrs[i] + b * k_bytes`` (V likewise with
``v_bytes``), work through ``min(len(gpu_block_ids), full blocks - start)`` blocks in order and
return how many leading ones were done; a write keeps bytes already stored for a block. A
call honours its timeout: past it, ``read`` and ``write`` stop between blocks and answer the
blocks done (whether the vendor's SDK answers so or raises is not known; FastDeploy handles
both: a short count, or an AttentionStoreSDKError it logs as 0).
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from attentionstore_sdk import reference_control as control
from attentionstore_sdk.api.common.common_pb2 import MEDIA_HBM
from attentionstore_sdk.client.client import AttentionType
from attentionstore_sdk.utils.err import AttentionStoreSDKError

_ROOT = hashlib.sha256(b"attentionstore-reference-root").digest()


class Tokens:
    """A token path from the root, cut into blocks of ``block_token_size``."""

    def __init__(self, token_ids: Sequence[int], block_token_size: int) -> None:
        if block_token_size <= 0:
            raise AttentionStoreSDKError(f"block_token_size must be > 0, got {block_token_size}")
        self.token_ids = [int(t) for t in token_ids]
        self.block_token_size = block_token_size
        self.num_blocks = len(self.token_ids) // block_token_size
        arr = np.asarray(self.token_ids[: self.num_blocks * block_token_size], dtype="<i8")
        hashes, h = [], _ROOT
        for i in range(self.num_blocks):
            chunk = arr[i * block_token_size : (i + 1) * block_token_size]
            h = hashlib.sha256(h + chunk.tobytes()).digest()
            hashes.append(h)
        self.block_hashes: list[bytes] = hashes


class _ReferenceSDK:
    """The store behind both constructor generations."""

    def _open(self, args: dict[str, Any], k_bytes: int, v_bytes: int) -> None:
        faults = control.faults()
        if "init" in faults.fail_ops:
            raise AttentionStoreSDKError(f"init: {faults.fail_message}")
        shard_id, shard_num = args["shard_id"], args["shard_num"]
        if not 0 <= shard_id < shard_num:
            raise AttentionStoreSDKError(f"shard_id {shard_id} out of range for {shard_num}")
        self.args = args
        self.layer_num = args["layer_num"]
        self.block_token_size = args["block_token_size"]
        self.k_bytes, self.v_bytes = k_bytes, v_bytes
        # a different cache geometry is a different store: its blocks could never be read here
        key = (
            args["namespace"],
            args["model_version"],
            shard_id,
            shard_num,
            self.layer_num,
            self.block_token_size,
            k_bytes,
            v_bytes,
        )
        with control.STATE.lock:
            store = control.STATE.stores.setdefault(
                key, control.Store(self.layer_num, k_bytes, v_bytes)
            )
            control.STATE.instances.append(self)
        self.store = store

    # -- the calls FastDeploy makes ----------------------------------------------------------

    def match(self, tokens: Tokens, start_block_idx: int, timeout: float) -> int:
        def run() -> int:
            n = 0
            with control.STATE.lock:
                for h in self._hashes(tokens, start_block_idx):
                    if not self._complete(self.store.blocks.get(h)):
                        break
                    n += 1
            return n

        return self._call("match", run, tokens, start_block_idx, timeout)

    def flush_token_index(
        self,
        layer_ids: Sequence[int],
        tokens: Tokens,
        start_block_idx: int,
        from_media: Any,
        to_media: Any,
    ) -> None:
        media = (from_media, to_media)
        hbm = [m is not None and type(m) is type(MEDIA_HBM) and m == MEDIA_HBM for m in media]
        if sorted(hbm) != [False, True] or None not in media:
            raise AttentionStoreSDKError(
                f"flush_token_index media {media!r}: expected (None, MEDIA_HBM) or "
                "(MEDIA_HBM, None)"
            )
        resident = to_media == MEDIA_HBM

        def run() -> None:
            self._check_layers(layer_ids, layer_ids, layer_ids)
            with control.STATE.lock:
                for h in self._hashes(tokens, start_block_idx):
                    self.store.resident[h] = resident

        self._call(
            "flush_token_index",
            run,
            tokens,
            start_block_idx,
            None,
            layer_ids=layer_ids,
            media=media,
            resident=resident,
        )

    # -- data movement shared by both generations --------------------------------------------

    def _read(self, layer_ids, tokens, start, k_ptrs, v_ptrs, gpu_block_ids, timeout, kwargs):
        def run() -> int:
            self._check_layers(layer_ids, k_ptrs, v_ptrs)
            hashes = self._hashes(tokens, start)[: len(gpu_block_ids)]
            stop = time.monotonic() + timeout
            for i, h in enumerate(hashes):
                if time.monotonic() >= stop:
                    return i  # out of time: the blocks copied so far
                with control.STATE.lock:
                    entry = self.store.blocks.get(h)
                if entry is None or any(lid not in entry for lid in layer_ids):
                    return i
                b = int(gpu_block_ids[i])
                for j, lid in enumerate(layer_ids):
                    k, v = entry[lid]
                    ctypes.memmove(k_ptrs[j] + b * self.k_bytes, k, self.k_bytes)
                    ctypes.memmove(v_ptrs[j] + b * self.v_bytes, v, self.v_bytes)
            return len(hashes)

        return self._call(
            "read",
            run,
            tokens,
            start,
            timeout,
            layer_ids=layer_ids,
            ids=gpu_block_ids,
            kwargs=kwargs,
        )

    def _write(self, layer_ids, tokens, start, k_ptrs, v_ptrs, gpu_block_ids, timeout, kwargs):
        def run() -> int:
            self._check_layers(layer_ids, k_ptrs, v_ptrs)
            hashes = self._hashes(tokens, start)[: len(gpu_block_ids)]
            stop = time.monotonic() + timeout
            for i, h in enumerate(hashes):
                if time.monotonic() >= stop or not control.take_write_budget():
                    return i  # out of time or space: the blocks stored so far
                b = int(gpu_block_ids[i])
                layers = {
                    lid: (
                        ctypes.string_at(k_ptrs[j] + b * self.k_bytes, self.k_bytes),
                        ctypes.string_at(v_ptrs[j] + b * self.v_bytes, self.v_bytes),
                    )
                    for j, lid in enumerate(layer_ids)
                }
                with control.STATE.lock:
                    entry = self.store.blocks.setdefault(h, {})
                    for lid, kv in layers.items():
                        entry.setdefault(lid, kv)
            return len(hashes)

        return self._call(
            "write",
            run,
            tokens,
            start,
            timeout,
            layer_ids=layer_ids,
            ids=gpu_block_ids,
            kwargs=kwargs,
        )

    # -- internals ---------------------------------------------------------------------------

    def _call(
        self,
        op: str,
        run: Callable[[], Any],
        tokens: Tokens,
        start: int,
        timeout: float | None,
        *,
        layer_ids: Sequence[int] = (),
        ids: Sequence[int] = (),
        media: tuple[Any, Any] | None = None,
        resident: bool | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        result: Any = None
        try:
            self._misbehave(op, timeout)
            result = run()
            return result
        finally:
            call = control.Call(
                op=op,
                sdk=self,
                start_block_idx=start,
                token_ids=tuple(tokens.token_ids) if isinstance(tokens, Tokens) else (),
                layer_ids=tuple(layer_ids),
                gpu_block_ids=tuple(int(b) for b in ids),
                media=media,
                reside_in_gpu=resident,
                timeout=timeout,
                kwargs=dict(kwargs or {}),
                result=result,
            )
            with control.STATE.lock:
                control.STATE.calls.append(call)

    def _misbehave(self, op: str, timeout: float | None) -> None:
        faults = control.faults()
        if faults.delay_s > 0 and timeout is not None:
            time.sleep(min(faults.delay_s, max(timeout, 0.0)))
            if faults.delay_s > timeout:
                raise AttentionStoreSDKError(f"{op} timed out after {timeout:.3f}s")
        if control.take_not_ready():
            raise AttentionStoreSDKError(control.NOT_READY_MESSAGE)
        if op in faults.fail_ops:
            raise AttentionStoreSDKError(f"{op}: {faults.fail_message}")

    def _hashes(self, tokens: Tokens, start: int) -> list[bytes]:
        if not isinstance(tokens, Tokens):
            raise AttentionStoreSDKError(f"tokens must be Tokens, got {type(tokens).__name__}")
        if tokens.block_token_size != self.block_token_size:
            raise AttentionStoreSDKError(
                f"Tokens use {tokens.block_token_size} tokens per block; the SDK was opened "
                f"with {self.block_token_size}"
            )
        if start < 0:
            raise AttentionStoreSDKError(f"start_block_idx must be >= 0, got {start}")
        return tokens.block_hashes[start:]

    def _check_layers(self, layer_ids: Sequence[int], k_ptrs, v_ptrs) -> None:
        if not len(layer_ids) == len(k_ptrs) == len(v_ptrs):
            raise AttentionStoreSDKError("layer_ids, k_ptrs and v_ptrs differ in length")
        bad = [lid for lid in layer_ids if not 0 <= lid < self.layer_num]
        if bad:
            raise AttentionStoreSDKError(f"layer ids {bad} out of range for {self.layer_num}")

    def _complete(self, entry: dict[int, tuple[bytes, bytes]] | None) -> bool:
        return entry is not None and len(entry) == self.layer_num


class AttentionStoreSDK(_ReferenceSDK):
    """The K/V-size constructor and its read/write keywords (FD lines 80-95, 155-164, 201-211)."""

    def __init__(
        self,
        namespace: str,
        pod_name: str,
        model_version: str,
        shard_id: int,
        shard_num: int,
        layer_num: int,
        block_token_size: int,
        k_bytes_per_shard_layer_per_block: int,
        v_bytes_per_shard_layer_per_block: int,
        device_id: int,
        dp_id: int,
        *,
        attention_type: AttentionType,
        enable_as_kv_rw: bool,
        gpu_count: int,
    ) -> None:
        if not isinstance(attention_type, AttentionType):
            raise AttentionStoreSDKError(f"attention_type {attention_type!r} is not AttentionType")
        args = {
            "namespace": namespace,
            "pod_name": pod_name,
            "model_version": model_version,
            "shard_id": shard_id,
            "shard_num": shard_num,
            "layer_num": layer_num,
            "block_token_size": block_token_size,
            "k_bytes_per_shard_layer_per_block": k_bytes_per_shard_layer_per_block,
            "v_bytes_per_shard_layer_per_block": v_bytes_per_shard_layer_per_block,
            "device_id": device_id,
            "dp_id": dp_id,
            "attention_type": attention_type,
            "enable_as_kv_rw": enable_as_kv_rw,
            "gpu_count": gpu_count,
        }
        self._open(args, k_bytes_per_shard_layer_per_block, v_bytes_per_shard_layer_per_block)

    def read(
        self,
        layer_ids: Sequence[int],
        tokens: Tokens,
        start_block_idx: int,
        k_ptrs: Sequence[int],
        v_ptrs: Sequence[int],
        gpu_block_ids: Sequence[int],
        timeout: float,
        *,
        remote_addrs: Any,
    ) -> int:
        kwargs = {"remote_addrs": remote_addrs}
        return self._read(
            layer_ids, tokens, start_block_idx, k_ptrs, v_ptrs, gpu_block_ids, timeout, kwargs
        )

    def write(
        self,
        layer_ids: Sequence[int],
        tokens: Tokens,
        start_block_idx: int,
        k_ptrs: Sequence[int],
        v_ptrs: Sequence[int],
        gpu_block_ids: Sequence[int],
        timeout: float,
        *,
        h2h_copy: bool,
        params: Any,
    ) -> int:
        kwargs = {"h2h_copy": h2h_copy, "params": params}
        return self._write(
            layer_ids, tokens, start_block_idx, k_ptrs, v_ptrs, gpu_block_ids, timeout, kwargs
        )


class PerBlockBytesAttentionStoreSDK(_ReferenceSDK):
    """The one-size constructor (FD lines 97-108, seed 002) and plain read/write (lines 166-174,
    213-221)."""

    def __init__(
        self,
        namespace: str,
        pod_name: str,
        model_version: str,
        shard_id: int,
        shard_num: int,
        layer_num: int,
        block_token_size: int,
        bytes_per_shard_layer_per_block: int,
        device_id: int,
        dp_id: int,
    ) -> None:
        args = {
            "namespace": namespace,
            "pod_name": pod_name,
            "model_version": model_version,
            "shard_id": shard_id,
            "shard_num": shard_num,
            "layer_num": layer_num,
            "block_token_size": block_token_size,
            "bytes_per_shard_layer_per_block": bytes_per_shard_layer_per_block,
            "device_id": device_id,
            "dp_id": dp_id,
        }
        nbytes = bytes_per_shard_layer_per_block
        self._open(args, nbytes, nbytes)

    def read(
        self,
        layer_ids: Sequence[int],
        tokens: Tokens,
        start_block_idx: int,
        k_ptrs: Sequence[int],
        v_ptrs: Sequence[int],
        gpu_block_ids: Sequence[int],
        timeout: float,
    ) -> int:
        return self._read(
            layer_ids, tokens, start_block_idx, k_ptrs, v_ptrs, gpu_block_ids, timeout, {}
        )

    def write(
        self,
        layer_ids: Sequence[int],
        tokens: Tokens,
        start_block_idx: int,
        k_ptrs: Sequence[int],
        v_ptrs: Sequence[int],
        gpu_block_ids: Sequence[int],
        timeout: float,
    ) -> int:
        return self._write(
            layer_ids, tokens, start_block_idx, k_ptrs, v_ptrs, gpu_block_ids, timeout, {}
        )
