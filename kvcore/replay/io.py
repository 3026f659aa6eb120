"""Replays with real bytes: a trace served through a :class:`~kvcore.transfer.TransferManager`
and an opened backend.

The "engine" is one cache layer in host memory (numpy), its block as big as ``block_bytes``
(K and V halves). Each request reads its stored leading run into the cache, checks every
restored byte (a block's bytes follow from its key alone), "computes" the rest and writes the
request back; the manager asks the backend what it admits before gathering anything. Requests
run one after another in trace order (timestamps give the order, their gaps are not waited):
the hit counts are then a function of the trace and the store's settings alone.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvcore.backend import Backend
from kvcore.errors import ConfigError
from kvcore.handles import BackendHandle
from kvcore.registry import load_backend_class
from kvcore.replay.capacity import capacity_holding
from kvcore.replay.model import Tally, block_key
from kvcore.replay.trace import Trace, TraceRequest
from kvcore.schemas import BackendContext, CacheDType, CacheLayout
from kvcore.tenants import TenantSettings, TenantShare
from kvcore.transfer import DeviceCache, TransferManager

__all__ = ["IOReplay", "replay_layout"]

#: bytes of one element of the replay's cache (bfloat16)
_ELEMENT = 2
_PARTS = 2  # K and V


def replay_layout(block_bytes: int, tokens_per_block: int, num_blocks: int) -> CacheLayout:
    """One layer and one head whose block (K and V) is ``block_bytes``."""
    per_part = block_bytes // _PARTS
    unit = tokens_per_block * _ELEMENT * 4  # head_dim a multiple of 4: 8-byte aligned rows
    if block_bytes <= 0 or per_part % unit:
        raise ConfigError(
            f"block_bytes: {block_bytes} must be a positive multiple of {unit * _PARTS} "
            f"(K and V halves of {tokens_per_block} tokens x 2-byte elements x 4)"
        )
    return CacheLayout(
        num_layers=1,
        num_heads=1,
        block_size=tokens_per_block,
        head_dim=per_part // (tokens_per_block * _ELEMENT),
        dtype=CacheDType.bfloat16,
        num_blocks=num_blocks,
    )


class _Engine:
    """The cache tensors and the bytes each block holds (K and V of one layer)."""

    def __init__(self, layout: CacheLayout) -> None:
        self.k = np.zeros(layout.kv_shape, dtype=np.uint16)
        self.v = np.zeros(layout.kv_shape, dtype=np.uint16)
        self.cache = DeviceCache(layout, [self.k], [self.v])
        words = layout.part_bytes("k") // 8
        self._rows = [t.view(np.uint64).reshape(layout.num_blocks, words) for t in (self.k, self.v)]
        self._ramp = np.arange(words, dtype=np.uint64)

    def _expected(self, hash_ids: np.ndarray, part: int) -> np.ndarray:
        base = hash_ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(part)
        return base[:, None] ^ self._ramp[None, :]

    def compute(self, slots: slice, hash_ids: np.ndarray) -> None:
        for part, rows in enumerate(self._rows):
            rows[slots] = self._expected(hash_ids, part)

    def wrong_blocks(self, slots: slice, hash_ids: np.ndarray) -> int:
        """Restored blocks whose bytes differ from what their key's block holds."""
        bad = np.zeros(len(hash_ids), dtype=bool)
        for part, rows in enumerate(self._rows):
            bad |= (rows[slots] != self._expected(hash_ids, part)).any(axis=1)
        return int(bad.sum())

    def scrub(self, slots: slice) -> None:
        for rows in self._rows:
            rows[slots] = 0


class IOReplay:
    """One store, opened for a replay at one capacity (the backend's own settings for it).

    :param backend: an installed backend's name; it must have the settings ``capacity_bytes``
        (and, for a policy other than ``all``, ``admission``), as kv_file has.
    :param config: the backend's other settings.
    :param store_settings: settings the replay puts into the backend's config where it has
        them (watermarks, admission tuning).
    :param tenants: the tenants' shares, in bytes of blocks of ``block_bytes``: the backend
        gets them scaled to the bytes its blocks take (its ``tenants`` setting).
    """

    def __init__(
        self,
        trace: Trace,
        backend: str,
        config: Mapping[str, Any],
        *,
        capacity_blocks: int,
        policy: str,
        block_bytes: int,
        store_settings: Mapping[str, Any],
        tenants: TenantSettings | None = None,
    ) -> None:
        self.trace = trace
        self.layout = replay_layout(
            block_bytes, trace.tokens_per_block, max(1, trace.longest_request_blocks)
        )
        fields = load_backend_class(backend).config_model.model_fields
        for needed in ("capacity_bytes", *(() if policy == "all" else ("admission",))):
            if needed not in fields:
                raise ConfigError(
                    f"backend {backend!r} has no {needed!r} setting: a replay at a capacity "
                    f"with policy {policy!r} needs one (kv_file has it)"
                )
        self.namespace = f"kvcore-replay-{uuid.uuid4().hex[:12]}"
        self._settings = {k: v for k, v in store_settings.items() if k in fields}
        if "admission" in fields:
            self._settings["admission"] = policy
        self._name, self._config = backend, dict(config)
        self.block_file_bytes, self._own_bytes_per_object = self._block_file_bytes()
        if tenants is not None:
            if "tenants" not in fields:
                raise ConfigError(
                    f"backend {backend!r} has no 'tenants' setting: a replay with tenants' "
                    "shares needs one (kv_file has it)"
                )
            self._settings["tenants"] = scale_shares(tenants, self.block_file_bytes, block_bytes)
        settings = {**self._config, **self._settings}
        settings["capacity_bytes"] = self._capacity_for(settings, capacity_blocks)
        self.backend = self._open(settings)

    def _open(self, settings: Mapping[str, Any]) -> Backend:
        context = BackendContext(layout=self.layout, namespace=self.namespace)
        return BackendHandle(self._name, dict(settings), context=context).open()

    def _capacity_for(self, settings: Mapping[str, Any], blocks: int) -> int:
        """``capacity_bytes`` that holds ``blocks`` blocks of objects and the store's own files
        at their size when the store is full (:func:`capacity_holding`): the objects get the
        capacity the store model has."""
        return capacity_holding(
            lambda capacity: self._open({**settings, "capacity_bytes": capacity}),
            blocks * self.block_file_bytes,
            objects=blocks * len(self.layout.parts),
            own_bytes_per_object=self._own_bytes_per_object,
        )

    def _block_file_bytes(self) -> tuple[int, float]:
        """Bytes one block takes in the store (headers included), and what each object adds
        to the store's own files (the stat ``own_files_bytes_per_object``; 0 without it):
        measured by storing one, since the store's capacity is in bytes and the replay's in
        blocks. The probe is a block as the trace names them (its first tenant's, its largest
        id: names, and the store's records of them, are as long as the trace's)."""
        requests = self.trace.requests
        tenant = next((r.tenant for r in requests if r.tenant is not None), None)
        largest = max((int(max(r.hash_ids)) for r in requests if len(r.hash_ids)), default=0)
        settings = {**self._config, **self._settings, "admission": "all"}
        if "admission" not in self._settings:
            settings.pop("admission")
        backend = self._open(settings)
        try:
            before = backend.stats().get("backend_bytes_used", 0.0)
            engine = _Engine(self.layout)
            with _manager(self.layout, engine, backend, self.trace, self.namespace) as tm:
                engine.compute(slice(0, 1), np.asarray([largest]))
                probe = {"keys": [block_key(largest, tenant)], "device_block_ids": [0]}
                result = tm.write_back({"task_id": "probe", **probe, "tenant": tenant}).result()
            after = backend.stats()
            used = after.get("backend_bytes_used", 0.0) - before
            own_per_object = float(after.get("backend_own_files_bytes_per_object", 0.0))
            backend.clear()
        finally:
            backend.close()
        if result.num_blocks != 1 or used <= 0:
            raise ConfigError(
                f"backend {self._name!r} did not store a probe block ({result.outcome}: "
                f"{result.error}) or reports no bytes_used: a replay at a capacity needs both"
            )
        return int(used), own_per_object

    def run(self, progress: Callable[[int], None] | None = None) -> Tally:
        """Replay the whole trace; the store is cleared and closed afterwards."""
        tally = Tally()
        engine = _Engine(self.layout)
        trace = self.trace
        tpb = trace.tokens_per_block
        try:
            with _manager(self.layout, engine, self.backend, trace, self.namespace) as tm:
                for n, request in enumerate(trace.requests):
                    hits = self._serve(tm, engine, tally, n, request)
                    tally.served(request, hits, tpb)
                    if request.tenant is not None:
                        tally.of(request.tenant).served(request, hits, tpb)
                    if progress is not None:
                        progress(1)
            stats = self.backend.stats()
            parts = len(self.layout.parts)
            tally.evictions = int(stats.get("backend_evictions", 0)) // parts
            stored = stats.get("backend_write_stored")
            if stored is not None:
                # what reached the disk: a write-back also hands the backend blocks it holds
                # beyond the leading run it found (skipped there, yet counted as done)
                tally.blocks_written = int(stored) // parts
                tally.bytes_written = tally.blocks_written * self.layout.block_bytes
        finally:
            try:
                self.backend.clear()
            finally:
                self.backend.close()
        return tally

    def _serve(
        self, tm: TransferManager, engine: _Engine, tally: Tally, n: int, request: TraceRequest
    ) -> int:
        """Request ``n``: read, check, compute, write back. Returns the blocks restored."""
        hash_ids = request.hash_ids
        keys = [block_key(b, request.tenant) for b in hash_ids]
        ids = np.asarray(hash_ids, dtype=np.int64)
        slots = list(range(len(keys)))
        engine.scrub(slice(0, len(keys)))
        t0 = time.perf_counter()
        task = {"keys": keys, "device_block_ids": slots, "tenant": request.tenant}
        read = tm.read({"task_id": f"r{n}", **task}).result()
        tally.read_latency_s.append(time.perf_counter() - t0)
        hits = read.num_blocks
        if read.outcome not in ("complete", "miss"):
            tally.error(f"request {n} read: {read.outcome}: {read.error}")
        if hits:
            tally.mismatches += engine.wrong_blocks(slice(0, hits), ids[:hits])
        engine.compute(slice(hits, len(keys)), ids[hits:])
        wrote = tm.write_back({"task_id": f"w{n}", **task}).result()
        if wrote.outcome not in ("complete", "miss"):
            tally.error(f"request {n} write: {wrote.outcome}: {wrote.error}")
        for counts in (tally,) if request.tenant is None else (tally, tally.of(request.tenant)):
            counts.blocks_written += wrote.num_blocks
            counts.bytes_written += wrote.bytes
            counts.blocks_refused += wrote.refused_blocks
        return hits


def scale_shares(tenants: TenantSettings, store_block: int, model_block: int) -> TenantSettings:
    """``tenants`` with each byte figure scaled from blocks of ``model_block`` bytes to blocks
    of ``store_block`` (the same number of blocks reserved, the same quota in blocks)."""

    def scaled(nbytes: int) -> int:
        return nbytes * store_block // model_block

    shares = {
        name: TenantShare(
            reserved_bytes=scaled(int(share.reserved_bytes)),  # type: ignore[arg-type]
            quota_bytes=None if share.quota_bytes is None else scaled(int(share.quota_bytes)),  # type: ignore[arg-type]
        )
        for name, share in tenants.tenants.items()
    }
    return tenants.model_copy(update={"tenants": shares})


def _manager(
    layout: CacheLayout, engine: _Engine, backend: Backend, trace: Trace, namespace: str
) -> TransferManager:
    # one task at a time in each direction: requests are served in order, as the model does
    return TransferManager(
        {
            "layout": layout,
            "namespace": namespace,
            "max_model_len": max(1, trace.longest_request_blocks) * layout.block_size,
            "default_timeout_s": 60.0,
            "read_workers": 1,
            "write_workers": 1,
        },
        engine.cache,
        backend,
    )
