# REFERENCE IMPLEMENTATION of the attentionstore_sdk surface FastDeploy calls (not the vendor SDK).
"""Test controls for the reference SDK: the shared stores, recorded calls and injected faults.

Not part of the vendor surface. The stores are process-global, keyed by namespace, model
version, shard and cache geometry, so a reopened backend finds what an earlier one wrote.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

NOT_READY_MESSAGE = "cuda memory not ready: device cache is not registered yet"


@dataclass
class Faults:
    """What the next SDK calls do wrong. Reset between tests by :func:`reset`."""

    #: the next N calls (any operation) raise "cuda memory not ready"
    not_ready_calls: int = 0
    #: operations that raise AttentionStoreSDKError: "init", "match", "read", "write",
    #: "flush_token_index"
    fail_ops: frozenset[str] = frozenset()
    fail_message: str = "injected failure"
    #: every call that takes a timeout takes this long; past its timeout it gives up
    delay_s: float = 0.0
    #: blocks writes may still store in total; when spent, writes come back short
    write_block_budget: int | None = None


@dataclass(frozen=True)
class Call:
    """One recorded SDK call (data calls and flushes; not the constructor)."""

    op: str
    sdk: Any
    start_block_idx: int
    token_ids: tuple[int, ...]
    layer_ids: tuple[int, ...] = ()
    gpu_block_ids: tuple[int, ...] = ()
    #: flush_token_index's two media arguments, as passed
    media: tuple[Any, Any] | None = None
    #: the residency a flush recorded: True (now in device memory), False (left it)
    reside_in_gpu: bool | None = None
    timeout: float | None = None  # None: the call takes no timeout (flush_token_index)
    kwargs: dict[str, Any] = field(default_factory=dict)
    result: int | None = None  # None: the call raised (or, for a flush, answers nothing)


@dataclass
class Store:
    """One shard's data: block hash -> {layer id: (K bytes, V bytes)}, and residency flags."""

    layer_num: int
    k_bytes: int
    v_bytes: int
    blocks: dict[bytes, dict[int, tuple[bytes, bytes]]] = field(default_factory=dict)
    resident: dict[bytes, bool] = field(default_factory=dict)


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.faults = Faults()
        self.stores: dict[tuple[object, ...], Store] = {}
        self.instances: list[Any] = []
        self.calls: list[Call] = []


STATE = _State()


def reset() -> None:
    """Forget every store, call and instance, and clear all faults."""
    with STATE.lock:
        STATE.faults = Faults()
        STATE.stores.clear()
        STATE.instances.clear()
        STATE.calls.clear()


def faults() -> Faults:
    return STATE.faults


def calls(op: str | None = None) -> list[Call]:
    """Recorded calls, oldest first, optionally only those of one operation."""
    with STATE.lock:
        return [c for c in STATE.calls if op is None or c.op == op]


def instances() -> list[Any]:
    with STATE.lock:
        return list(STATE.instances)


def take_not_ready() -> bool:
    """Consume one injected "not ready" answer, if any remain."""
    with STATE.lock:
        if STATE.faults.not_ready_calls > 0:
            STATE.faults.not_ready_calls -= 1
            return True
        return False


def take_write_budget() -> bool:
    """Consume one block of write budget; False when the budget is spent."""
    with STATE.lock:
        budget = STATE.faults.write_block_budget
        if budget is None:
            return True
        if budget <= 0:
            return False
        STATE.faults.write_block_budget = budget - 1
        return True
