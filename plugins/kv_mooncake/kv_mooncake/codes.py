"""Mooncake's integer return codes, turned into the miss reasons this backend counts.

The Python binding returns plain ints (its ErrorCode enum is not exposed): ``0`` for a
successful put, a byte count for a successful get, ``1``/``0`` for exists, negatives for
errors. Every failure becomes a counted miss; none is raised. A negative code other than
"not found" is a failure, reported to the engine (:func:`failure`).
"""

from __future__ import annotations

__all__ = [
    "ALREADY_EXISTS",
    "HAS_LEASE",
    "INVALID_PARAMS",
    "INVALID_WRITE",
    "NOT_FOUND",
    "NO_SPACE",
    "REPLICA_NOT_READY",
    "RPC_FAILED",
    "RPC_TIMEOUT",
    "TRANSFER_FAILED",
    "failure",
    "reason",
]

NO_SPACE = -200
INVALID_PARAMS = -600
#: a put of a key whose put another client has in flight at that moment (two writers of one
#: block: measured with Mooncake 0.3.13, one of two concurrent upserts of a key answers it)
INVALID_WRITE = -601
REPLICA_NOT_READY = -703
NOT_FOUND = -704
ALREADY_EXISTS = -705
HAS_LEASE = -706
LEASE_EXPIRED = -707
TRANSFER_FAILED = -800
RPC_FAILED = -900
RPC_TIMEOUT = -901

_REASONS = {
    NO_SPACE: "no_space",
    INVALID_PARAMS: "invalid_params",
    INVALID_WRITE: "invalid_write",
    REPLICA_NOT_READY: "replica_not_ready",
    NOT_FOUND: "not_found",
    HAS_LEASE: "has_lease",
    LEASE_EXPIRED: "lease_expired",
    TRANSFER_FAILED: "transfer_failed",
    RPC_FAILED: "rpc_failed",
    RPC_TIMEOUT: "rpc_timeout",
}


def reason(code: int) -> str:
    """Name of the miss reason for a negative Mooncake code (``other`` when unknown)."""
    return _REASONS.get(code, "other")


def failure(call: str, code: int) -> str:
    """The ``Outcome.failure`` text for a Mooncake call that answered ``code``."""
    return f"mooncake {call} answered {code} ({reason(code)})"
