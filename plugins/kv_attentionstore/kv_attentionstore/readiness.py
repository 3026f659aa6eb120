"""Wait, at open, until the SDK can serve requests.

The SDK answers "cuda memory not ready" until the engine's cache tensors are registered with
it; that is worth retrying. Any other error (wrong namespace, unreachable service) will not fix
itself, so it fails the open at once instead of burning the whole timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kv_attentionstore.sdk_loader import SdkModule, is_not_ready

log = logging.getLogger("kvcore.attentionstore")


class SdkNotReadyError(TimeoutError):
    """The SDK kept reporting "not ready" for the whole readiness timeout."""


class SdkStartError(RuntimeError):
    """The SDK failed in a way retrying cannot fix."""


def wait_until_ready(
    client: Any,
    sdk: SdkModule,
    *,
    block_token_size: int,
    timeout_s: float,
    poll_s: float,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Probe with a one-block ``match`` until it answers; return how many probes said not ready.

    The deadline is measured on the monotonic clock, so slow probes count against it too. A
    probe that fails for any other reason (its own timeout included) fails the open at once.
    """
    # any one-block path will do: only whether the SDK answers matters, not what it matches
    probe = sdk.tokens_class(list(range(block_token_size + 1)), block_token_size)
    deadline = time.monotonic() + timeout_s
    not_ready = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SdkNotReadyError(
                f"AttentionStore SDK still not ready after {timeout_s:g}s ({not_ready} probes "
                "said 'cuda memory not ready'); raise readiness_timeout_s (AS_READINESS_TIMEOUT_S) "
                "or check that the engine registered its cache with AttentionStore"
            )
        try:
            client.match(probe, 0, min(poll_s, left))
        except Exception as exc:
            if not is_not_ready(exc, sdk):
                raise SdkStartError(
                    f"AttentionStore SDK failed its readiness probe: {type(exc).__name__}: {exc}"
                ) from exc
            not_ready += 1
            log.debug("AttentionStore SDK not ready (probe %d): %s", not_ready, exc)
            sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))
            continue
        if not_ready:
            log.info("AttentionStore SDK ready after %d not-ready probes", not_ready)
        return not_ready
