# REFERENCE IMPLEMENTATION of the documented attentionstore_sdk surface, for kvcore's tests.
# It is NOT the vendor SDK and shares no code with it: it implements, in plain Python, only
# the calls the kv_attentionstore backend makes (see plugins/kv_attentionstore/README.md), with
# the behaviour that README documents, plus `reference_control` to inject faults.
"""Stand-in for the vendor ``attentionstore_sdk`` package (tests only)."""
