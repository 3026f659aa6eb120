# REFERENCE IMPLEMENTATION of the attentionstore_sdk surface FastDeploy calls, for kvcore's tests.
# It is NOT the vendor SDK and shares no code with it. Every module, class and call here is one
# that FastDeploy's AttentionStore backend uses, labelled with where that use was read:
#   FD = PaddlePaddle/FastDeploy@1af00818db85f4e844327e9ba5ccfacff1afe9bf,
#        fastdeploy/cache_manager/transfer_factory/mooncake_store/attention_store.py
# `reference_control` (not part of the surface) holds the stores and injects faults.
"""Stand-in for the vendor ``attentionstore_sdk`` package (tests only)."""
