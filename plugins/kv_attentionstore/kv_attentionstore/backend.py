"""The ``attentionstore`` kvcore backend: token-addressed, device I/O, with a flushable index.

The SDK copies blocks itself, straight between its store and the engine's per-layer cache
tensors, so a request carries per-layer K/V pointers and device block ids rather than host
buffers. Every SDK call is made the way FastDeploy makes it (argument order, keyword arguments,
media constants; see the package README), with the request's remaining time as the timeout
where the SDK takes one. The backend never abandons a call in flight, because the SDK would
keep copying into (or out of) device blocks the engine has already reused.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import kvcore
from kv_attentionstore.config import AttentionStoreConfig, SdkSettings, resolve_settings
from kv_attentionstore.readiness import SdkStartError, wait_until_ready
from kv_attentionstore.request_mapping import TokenSpan, clamp_count, token_span
from kv_attentionstore.sdk_loader import load_sdk
from kvcore import BlockRequest, FailureKind, Outcome

log = logging.getLogger("kvcore.attentionstore")


class AttentionStoreBackend:
    """kvcore backend over ``attentionstore_sdk.sdk.AttentionStoreSDK``.

    No ``kvcore_remove`` or ``kvcore_clear``: the SDK surface FastDeploy uses has no way to
    delete (FastDeploy's own ``AttentionStore.clear`` raises NotImplementedError).
    """

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
        self._sdk = load_sdk()
        self.settings: SdkSettings = resolve_settings(config, context, self._sdk)
        self._counters = kvcore.Counters()
        self._failures = kvcore.OnceLogger(log)
        # only_flush admits fp8 layouts (no data moves); their blocks can never be read back
        layout = context.layout
        self._data_ops = not (layout is not None and layout.dtype.has_scales)
        args, kwargs = self.settings.constructor_call(self._sdk)
        try:
            self._client: Any = self._sdk.sdk_class(*args, **kwargs)
        except Exception as exc:
            raise SdkStartError(
                f"AttentionStoreSDK{args!r} ({self.settings.constructor} constructor) failed: "
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
            "%d tokens per block, %s constructor%s",
            self.settings.namespace,
            self.settings.pod_name,
            self.settings.shard_id,
            self.settings.shard_num,
            self.settings.layer_num,
            self.settings.block_token_size,
            self.settings.constructor,
            ", index only (FD_AS_ONLY_FLUSH)" if config.only_flush else "",
        )

    # -- hooks -----------------------------------------------------------------------------

    @kvcore.hookimpl
    def kvcore_query(self, request: BlockRequest) -> int:
        span = self._span(request)
        if span.num_blocks == 0 or not self._data_ops:
            return 0
        timeout = self._timeout(request, "query")
        if timeout is None:
            return Outcome(0, "deadline passed before the SDK call", FailureKind.DEADLINE)
        try:
            got = self._client.match(self._tokens(span.token_ids), span.start_block, timeout)
        except Exception as exc:
            return self._sdk_failure("query", exc, request)
        return self._result("query", got, span.num_blocks)

    @kvcore.hookimpl
    def kvcore_read(self, request: BlockRequest) -> int:
        span = self._span(request)
        if span.num_blocks == 0 or not self._data_ops:
            return 0
        timeout = self._timeout(request, "read")
        if timeout is None:
            return Outcome(0, "deadline passed before the SDK call", FailureKind.DEADLINE)
        dev = request.device
        assert dev is not None  # the core sends device buffers to io="device" backends
        try:
            got = self._client.read(
                list(dev.layer_ids),
                self._tokens(span.token_ids),
                span.start_block,
                list(dev.k_ptrs),
                list(dev.v_ptrs),
                list(dev.block_ids[: span.num_blocks]),
                timeout,
                **self.settings.read_kwargs,
            )
        except Exception as exc:
            return self._sdk_failure("read", exc, request)
        return self._result("read", got, span.num_blocks)

    @kvcore.hookimpl
    def kvcore_write(self, request: BlockRequest) -> int:
        span = self._span(request)
        if span.num_blocks == 0:
            return 0
        if self.config.only_flush:
            # FastDeploy's FD_AS_ONLY_FLUSH: the store keeps no data, only the record that
            # these blocks now live in this pod's device memory
            self._flush(request, span, resident_on_device=True)
            self._counters.add("write_only_flush")
            return 0
        deadline = request.deadline
        if self.config.write_total_timeout is not None:
            # FastDeploy's AS_WRITE_TOTAL_TIMEOUT: a cap on the whole write, slices included
            deadline = min(deadline, time.monotonic() + self.config.write_total_timeout)
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            self._counters.add("write_deadline_expired")
            return Outcome(0, "deadline passed before the SDK call", FailureKind.DEADLINE)
        # Only the suffix the store lacks is sent: matched blocks hold the same bytes already.
        try:
            matched = self._client.match(self._tokens(span.token_ids), span.start_block, timeout)
        except Exception as exc:
            return self._sdk_failure("write_match", exc, request)
        done = self._result("write_match", matched, span.num_blocks)
        self._counters.add("write_skipped_blocks", done)
        while done < span.num_blocks:
            left = deadline - time.monotonic()
            if left <= 0:
                self._counters.add("write_deadline_stops")
                return Outcome(done, "deadline passed between write slices", FailureKind.DEADLINE)
            size = min(self.config.write_slice_block_num, span.num_blocks - done)
            written = self._write_slice(request, span, done, size, left)
            done += written
            if written < size:
                # a later block without this one would break the prefix: stop here
                self._counters.add("write_short_slices")
                return Outcome(done, getattr(written, "failure", None))
        return done

    @kvcore.hookimpl
    def kvcore_flush_token_index(self, request: BlockRequest, resident_on_device: bool) -> int:
        span = self._span(request)
        if span.num_blocks == 0:
            return 0
        return self._flush(request, span, resident_on_device)

    @kvcore.hookimpl
    def kvcore_stats(self) -> dict[str, float]:
        return self._counters.snapshot()

    @kvcore.hookimpl
    def kvcore_close(self) -> None:
        close = getattr(self._client, "close", None)  # not part of the surface FastDeploy uses
        if callable(close):
            with contextlib.suppress(Exception):  # shutting down: nothing to recover
                close()

    # -- internals -------------------------------------------------------------------------

    def _flush(self, request: BlockRequest, span: TokenSpan, resident_on_device: bool) -> int:
        """``flush_token_index`` as FastDeploy calls it (attention_store.py at 1af00818, lines
        253-268): no timeout, and the residency given as two media arguments - ``(None,
        MEDIA_HBM)`` when the blocks now live in device memory, ``(MEDIA_HBM, None)`` when they
        left it."""
        if request.expired():
            # no timeout can be passed, so an expired request must not start a call
            self._counters.add("flush_deadline_expired")
            return Outcome(0, "deadline passed before the SDK call", FailureKind.DEADLINE)
        hbm = self._sdk.media_hbm
        media = (None, hbm) if resident_on_device else (hbm, None)
        try:
            got = self._client.flush_token_index(
                self.settings.layer_ids, self._tokens(span.token_ids), span.start_block, *media
            )
        except Exception as exc:
            return self._sdk_failure("flush", exc, request)
        self._counters.add("flush_resident" if resident_on_device else "flush_evicted")
        if got is None:
            # FastDeploy never reads this call's answer; no error means the span was recorded
            return span.num_blocks
        return self._result("flush", got, span.num_blocks)

    def _write_slice(
        self, request: BlockRequest, span: TokenSpan, offset: int, size: int, time_left: float
    ) -> int:
        """Write blocks ``offset .. offset + size`` of the span; return the leading count.

        One slice is one SDK write, as FastDeploy cuts them (``AS_WRITE_SLICE_BLOCK_NUM``
        blocks, ``AS_WRITE_SLICE_TIMEOUT`` seconds each, tokens through the slice's end).
        """
        dev = request.device
        assert dev is not None
        try:
            got = self._client.write(
                list(dev.layer_ids),
                self._tokens(span.through(offset + size)),
                span.start_block + offset,
                list(dev.k_ptrs),
                list(dev.v_ptrs),
                list(dev.block_ids[offset : offset + size]),
                min(self.config.write_slice_timeout, time_left),
                **self.settings.write_kwargs,
            )
        except Exception as exc:
            return self._sdk_failure("write", exc, request)
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
            return Outcome(0, f"SDK {op} returned {value!r}, not a block count")
        return count

    def _sdk_failure(self, op: str, exc: BaseException, request: BlockRequest) -> Outcome:
        """Count an SDK failure, log the first of each kind, and answer with a failed miss."""
        kind = type(exc).__name__
        self._counters.add(f"{op}_sdk_errors")
        self._failures.warning(
            (op, kind),
            "AttentionStore %s failed (task %r): %s: %s; counted as a miss (further %s errors "
            "in %s are logged at debug level)",
            op,
            request.task_id,
            kind,
            exc,
            kind,
            op,
        )
        return Outcome(0, f"{kind}: {exc}")
