"""Move KV blocks between an engine's device cache, a host cache and a storage backend.

Layers (each imports only those before it): ``config`` (settings) < ``caches``, ``staging``
and ``policy`` (memory, what to store) < ``scheduler`` (pools, deadlines, futures) <
``integrity`` (block digests for backends without checksums) < ``storage`` (how blocks reach
the backend: staged, host-resident, device-direct) < ``blocks`` (a read or write-back from the
door to its result) < ``manager`` (the public API).
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
