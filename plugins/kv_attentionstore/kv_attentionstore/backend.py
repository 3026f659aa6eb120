"""The ``attentionstore`` kvcore backend: token-addressed, device I/O, with a flushable index.

The SDK copies blocks itself, straight between its store and the engine's per-layer cache
tensors, so a request carries per-layer K/V pointers and device block ids rather than host
buffers. Every SDK call gets the request's remaining time as its timeout; the backend never
abandons a call in flight, because the SDK would keep copying into (or out of) device blocks
the engine has already reused.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import kvcore
from kv_attentionstore.config import AttentionStoreConfig, SdkSettings, resolve_settings
from kv_attentionstore.counters import Counters
from kv_attentionstore.readiness import SdkStartError, wait_until_ready
from kv_attentionstore.request_mapping import (
    DeviceArgs,
    TokenSpan,
    clamp_count,
    device_args,
    token_span,
)
from kv_attentionstore.sdk_loader import load_sdk
from kvcore import BlockRequest

log = logging.getLogger("kv_attentionstore")


class AttentionStoreBackend:
    """kvcore backend over ``attentionstore_sdk.sdk.AttentionStoreSDK``."""

    name = "attentionstore"
    config_model = AttentionStoreConfig
    # The SDK has no scale pointers, so block-wise fp8 caches cannot round-trip (scales=False).
    # Data lives in the AttentionStore service, shared by pods and surviving engine restarts.
    capabilities = kvcore.Capabilities(
        addressing="token",
        io="device",
        token_index=True,
        scales=False,
        persistent=True,
        shared=True,
    )

    def __init__(self, config: AttentionStoreConfig, context: kvcore.BackendContext) -> None:
        self.config = config
        self.settings: SdkSettings = resolve_settings(config, context)
        self._sdk = load_sdk()
        self._counters = Counters()
        try:
            self._client: Any = self._sdk.sdk_class(*self.settings.constructor_args())
        except Exception as exc:
            raise SdkStartError(
                f"AttentionStoreSDK{self.settings.constructor_args()!r} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        not_ready = wait_until_ready(
            self._client,
            self._sdk,
            block_token_size=self.settings.block_token_size,
            timeout_s=config.readiness_timeout_s,
            poll_s=config.readiness_poll_s,
        )
        self._counters.add("readiness_not_ready_probes", not_ready)
        log.info(
            "AttentionStore backend open: namespace=%r pod=%r shard %d/%d, %d layers, "
            "%d tokens per block",
            self.settings.namespace,
            self.settings.pod_name,
            self.settings.shard_id,
            self.settings.shard_num,
            self.settings.layer_num,
            self.settings.block_token_size,
        )

    # -- hooks -----------------------------------------------------------------------------

    @kvcore.hookimpl
    def kvcore_query(self, request: BlockRequest) -> int:
        span = self._span(request)
        if span.num_blocks == 0:
            return 0
        timeout = self._timeout(request, "query")
        if timeout is None:
            return 0
        try:
            got = self._client.match(self._tokens(span.token_ids), span.start_block, timeout)
        except Exception as exc:
            self._counters.sdk_failure("query", exc, request.task_id)
            return 0
        return self._result("query", got, span.num_blocks)

    @kvcore.hookimpl
    def kvcore_read(self, request: BlockRequest) -> int:
        span = self._span(request)
        dev = device_args(request, self.settings)
        if span.num_blocks == 0:
            return 0
        timeout = self._timeout(request, "read")
        if timeout is None:
            return 0
        try:
            got = self._client.read(
                dev.layer_ids,
                self._tokens(span.token_ids),
                span.start_block,
                dev.k_ptrs,
                dev.v_ptrs,
                dev.block_ids[: span.num_blocks],
                timeout,
            )
        except Exception as exc:
            self._counters.sdk_failure("read", exc, request.task_id)
            return 0
        return self._result("read", got, span.num_blocks)

    @kvcore.hookimpl
    def kvcore_write(self, request: BlockRequest) -> int:
        span = self._span(request)
        dev = device_args(request, self.settings)
        if span.num_blocks == 0:
            return 0
        timeout = self._timeout(request, "write")
        if timeout is None:
            return 0
        # Only the suffix the store lacks is sent: matched blocks hold the same bytes already.
        try:
            matched = self._client.match(self._tokens(span.token_ids), span.start_block, timeout)
        except Exception as exc:
            self._counters.sdk_failure("write_match", exc, request.task_id)
            return 0
        done = self._result("write_match", matched, span.num_blocks)
        self._counters.add("write_skipped_blocks", done)
        while done < span.num_blocks:
            left = request.time_left()
            if left <= 0:
                self._counters.add("write_deadline_stops")
                break
            size = min(self.config.write_slice_blocks, span.num_blocks - done)
            written = self._write_slice(request, span, dev, done, size, left)
            done += written
            if written < size:
                # a later block without this one would break the prefix: stop here
                self._counters.add("write_short_slices")
                break
        return done

    @kvcore.hookimpl
    def kvcore_flush_token_index(self, request: BlockRequest, resident_on_device: bool) -> int:
        if not isinstance(resident_on_device, bool):
            raise ValueError(
                f"request {request.task_id!r}: resident_on_device must be a bool, got "
                f"{resident_on_device!r}"
            )
        span = self._span(request)
        if span.num_blocks == 0:
            return 0
        timeout = self._timeout(request, "flush")
        if timeout is None:
            return 0
        try:
            got = self._client.flush_token_index(
                list(range(self.settings.layer_num)),
                self._tokens(span.token_ids),
                span.start_block,
                resident_on_device,
                timeout,
            )
        except Exception as exc:
            self._counters.sdk_failure("flush", exc, request.task_id)
            return 0
        self._counters.add("flush_resident" if resident_on_device else "flush_evicted")
        return self._result("flush", got, span.num_blocks)

    @kvcore.hookimpl
    def kvcore_stats(self) -> dict[str, float]:
        return self._counters.snapshot()

    @kvcore.hookimpl
    def kvcore_close(self) -> None:
        close = getattr(self._client, "close", None)  # not part of the documented surface
        if callable(close):
            with contextlib.suppress(Exception):  # shutting down: nothing to recover
                close()

    # -- internals -------------------------------------------------------------------------

    def _write_slice(
        self,
        request: BlockRequest,
        span: TokenSpan,
        dev: DeviceArgs,
        offset: int,
        size: int,
        time_left: float,
    ) -> int:
        """Write blocks ``offset .. offset + size`` of the span; return the leading count."""
        try:
            got = self._client.write(
                dev.layer_ids,
                self._tokens(span.through(offset + size)),
                span.start_block + offset,
                dev.k_ptrs,
                dev.v_ptrs,
                dev.block_ids[offset : offset + size],
                min(self.config.write_slice_timeout_s, time_left),
            )
        except Exception as exc:
            self._counters.sdk_failure("write", exc, request.task_id)
            return 0
        self._counters.add("write_slices")
        return self._result("write", got, size)

    def _span(self, request: BlockRequest) -> TokenSpan:
        return token_span(request, self.settings.block_token_size)

    def _tokens(self, token_ids: list[int]) -> Any:
        return self._sdk.tokens_class(token_ids, self.settings.block_token_size)

    def _timeout(self, request: BlockRequest, op: str) -> float | None:
        """Seconds the SDK may take for ``op``, or None when the deadline already passed."""
        left = request.time_left()
        if left <= 0:
            self._counters.add(f"{op}_deadline_expired")
            return None
        return left

    def _result(self, op: str, value: object, limit: int) -> int:
        count = clamp_count(value, limit)
        if count is None:
            self._counters.add(f"{op}_bad_results")
            log.debug("AttentionStore %s returned %r, not a block count", op, value)
            return 0
        return count
