"""kvcore's ``tiered`` backend: an ordered stack of other kvcore backends, opened by name."""

from kv_tiered.backend import TieredBackend
from kv_tiered.config import TieredConfig, TierSpec
from kvcore.versions import installed_version

__all__ = ["TierSpec", "TieredBackend", "TieredConfig", "__version__"]

__version__ = installed_version("kvcore-tiered")
