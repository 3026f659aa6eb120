"""Move KV blocks between an engine's device cache, a host cache and a storage backend."""

from kvcore.transfer.buffers import DeviceCache, HostCache, StagingPool
from kvcore.transfer.config import TransferConfig
from kvcore.transfer.executor import QueueFullError, TaskFuture
from kvcore.transfer.manager import TransferManager, combine_ranks

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
