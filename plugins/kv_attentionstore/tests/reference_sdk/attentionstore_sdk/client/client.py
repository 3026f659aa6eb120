# REFERENCE IMPLEMENTATION (not the vendor SDK).
"""``AttentionType``: FD line 37 imports it (only for the K/V-size constructor, on CUDA) and line
92 passes ``attention_type=AttentionType.MHA``. MHA is the only member FastDeploy uses; MLA is
ours, so tests can name a member other than the default."""

from __future__ import annotations

import enum


class AttentionType(enum.Enum):
    MHA = "MHA"
    MLA = "MLA"
