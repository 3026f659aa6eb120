# REFERENCE IMPLEMENTATION (not the vendor SDK).
"""The SDK's one exception type (FD line 34 imports it; lines 117-131 tell "not ready" apart by
the text "cuda memory not ready" in its message)."""


class AttentionStoreSDKError(Exception):
    """Any failure inside the SDK (argument errors, timeouts, "cuda memory not ready")."""
