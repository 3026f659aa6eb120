"""Move KV blocks between an engine's device cache, a host cache and a storage backend.

Layers (each imports only those before it): ``config`` (settings) < ``caches`` and ``staging``
(memory) < ``scheduler`` (pools, deadlines, futures) < ``storage`` (how blocks reach the
backend: staged, host-resident, device-direct) < ``manager`` (the public API).
"""

from kvcore.transfer.caches import DeviceCache, HostCache
from kvcore.transfer.config import TransferConfig
from kvcore.transfer.manager import TransferManager, combine_ranks
from kvcore.transfer.scheduler import QueueFullError, TaskFuture
from kvcore.transfer.staging import StagingPool

__all__ = [
    "DeviceCache",
    "HostCache",
    "QueueFullError",
    "StagingPool",
    "TaskFuture",
    "TransferConfig",
    "TransferManager",
    "combine_ranks",
]
