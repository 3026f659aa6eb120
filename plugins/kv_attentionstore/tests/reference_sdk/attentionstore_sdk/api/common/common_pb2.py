# REFERENCE IMPLEMENTATION (not the vendor SDK).
"""The media constants of ``flush_token_index``.

FD line 32 imports ``attentionstore_sdk.api.common.common_pb2``; lines 255-268 pass
``common_pb2.MEDIA_HBM`` (device memory) as one of flush_token_index's two media arguments and
None as the other. FastDeploy reads no other member. The value is ours, and unusual on
purpose, so a caller that hardcodes a number (or passes a bool) instead of the constant fails.
"""

MEDIA_HBM = 7
