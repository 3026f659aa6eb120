# REFERENCE IMPLEMENTATION of the documented attentionstore_sdk surface (not the vendor SDK).
