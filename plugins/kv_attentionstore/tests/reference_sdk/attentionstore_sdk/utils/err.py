# REFERENCE IMPLEMENTATION of the documented attentionstore_sdk surface (not the vendor SDK).
"""The SDK's one exception type; "not ready" is told apart by its message."""


class AttentionStoreSDKError(Exception):
    """Any failure inside the SDK (argument errors, timeouts, "cuda memory not ready")."""
