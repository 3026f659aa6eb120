# REFERENCE IMPLEMENTATION of the documented attentionstore_sdk surface (not the vendor SDK).
"""``AttentionStoreSDK`` and ``Tokens`` as the kv_attentionstore backend calls them.

Behaviour implemented (and documented in plugins/kv_attentionstore/README.md):

- A block is named by the hash of every token from the root through its last token, so equal
  names mean equal prefixes; only full blocks of a ``Tokens`` have names.
- ``match`` counts consecutive stored blocks from ``start_block_idx``.
- ``read``/``write`` copy each block of each listed layer between the store and the device
  tensor at ``k_ptrs[i]``/``v_ptrs[i]``: block ``b`` starts at ``ptr + b *
  bytes_per_shard_layer_per_block``. They work through ``min(len(gpu_block_ids), full blocks
  - start)`` blocks in order and return how many leading ones were done. A write keeps bytes
  already stored for a block (names are content-derived, so they are equal).
- ``flush_token_index`` records where blocks from ``start_block_idx`` live (``reside_in_gpu``)
  without touching their data, and returns how many blocks it covered.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from collections.abc import Sequence

import numpy as np

from attentionstore_sdk import reference_control as control
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


class AttentionStoreSDK:
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
        faults = control.faults()
        if "init" in faults.fail_ops:
            raise AttentionStoreSDKError(f"init: {faults.fail_message}")
        if not 0 <= shard_id < shard_num:
            raise AttentionStoreSDKError(f"shard_id {shard_id} out of range for {shard_num}")
        self.args = {
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
        self.layer_num = layer_num
        self.block_token_size = block_token_size
        self.block_bytes = bytes_per_shard_layer_per_block
        # a different cache geometry is a different store: its blocks could never be read here
        key = (
            namespace,
            model_version,
            shard_id,
            shard_num,
            layer_num,
            block_token_size,
            bytes_per_shard_layer_per_block,
        )
        with control.STATE.lock:
            store = control.STATE.stores.setdefault(key, control.Store(layer_num, self.block_bytes))
            control.STATE.instances.append(self)
        self.store = store

    # -- the surface -----------------------------------------------------------------------

    def match(self, tokens: Tokens, start_block_idx: int, timeout: float) -> int:
        def run() -> int:
            hashes = self._hashes(tokens, start_block_idx)
            n = 0
            with control.STATE.lock:
                for h in hashes:
                    if not self._complete(self.store.blocks.get(h)):
                        break
                    n += 1
            return n

        return self._call("match", run, tokens, start_block_idx, timeout)

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
        def run() -> int:
            self._check_layers(layer_ids, k_ptrs, v_ptrs)
            hashes = self._hashes(tokens, start_block_idx)[: len(gpu_block_ids)]
            for i, h in enumerate(hashes):
                with control.STATE.lock:
                    entry = self.store.blocks.get(h)
                if entry is None or any(lid not in entry for lid in layer_ids):
                    return i
                offset = int(gpu_block_ids[i]) * self.block_bytes
                for j, lid in enumerate(layer_ids):
                    k, v = entry[lid]
                    ctypes.memmove(k_ptrs[j] + offset, k, self.block_bytes)
                    ctypes.memmove(v_ptrs[j] + offset, v, self.block_bytes)
            return len(hashes)

        return self._call(
            "read", run, tokens, start_block_idx, timeout, layer_ids=layer_ids, ids=gpu_block_ids
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
        def run() -> int:
            self._check_layers(layer_ids, k_ptrs, v_ptrs)
            hashes = self._hashes(tokens, start_block_idx)[: len(gpu_block_ids)]
            for i, h in enumerate(hashes):
                if not control.take_write_budget():
                    return i
                offset = int(gpu_block_ids[i]) * self.block_bytes
                layers = {
                    lid: (
                        ctypes.string_at(k_ptrs[j] + offset, self.block_bytes),
                        ctypes.string_at(v_ptrs[j] + offset, self.block_bytes),
                    )
                    for j, lid in enumerate(layer_ids)
                }
                with control.STATE.lock:
                    entry = self.store.blocks.setdefault(h, {})
                    for lid, kv in layers.items():
                        entry.setdefault(lid, kv)
            return len(hashes)

        return self._call(
            "write", run, tokens, start_block_idx, timeout, layer_ids=layer_ids, ids=gpu_block_ids
        )

    def flush_token_index(
        self,
        layer_ids: Sequence[int],
        tokens: Tokens,
        start_block_idx: int,
        reside_in_gpu: bool,
        timeout: float,
    ) -> int:
        def run() -> int:
            self._check_layers(layer_ids, layer_ids, layer_ids)
            hashes = self._hashes(tokens, start_block_idx)
            with control.STATE.lock:
                for h in hashes:
                    self.store.resident[h] = bool(reside_in_gpu)
            return len(hashes)

        return self._call(
            "flush_token_index",
            run,
            tokens,
            start_block_idx,
            timeout,
            layer_ids=layer_ids,
            resident=bool(reside_in_gpu),
        )

    # -- internals -------------------------------------------------------------------------

    def _call(
        self,
        op: str,
        run,
        tokens: Tokens,
        start: int,
        timeout: float,
        *,
        layer_ids: Sequence[int] = (),
        ids: Sequence[int] = (),
        resident: bool | None = None,
    ) -> int:
        result: int | None = None
        try:
            self._misbehave(op, timeout)
            result = run()
            return result
        finally:
            call = control.Call(
                op=op,
                sdk=self,
                start_block_idx=start,
                token_ids=tuple(tokens.token_ids),
                layer_ids=tuple(layer_ids),
                gpu_block_ids=tuple(int(b) for b in ids),
                reside_in_gpu=resident,
                timeout=timeout,
                result=result,
            )
            with control.STATE.lock:
                control.STATE.calls.append(call)

    def _misbehave(self, op: str, timeout: float) -> None:
        faults = control.faults()
        if faults.delay_s > 0:
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
