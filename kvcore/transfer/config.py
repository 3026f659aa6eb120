"""Settings of a :class:`~kvcore.transfer.TransferManager`."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from kvcore.schemas import CacheLayout, EnvConfig

__all__ = ["TransferConfig"]


class TransferConfig(EnvConfig):
    """How the manager sizes its buffers, threads and queues, and when it writes back.

    Every field can be overridden with ``KVCORE_TRANSFER_<FIELD>`` (e.g.
    ``KVCORE_TRANSFER_WRITE_WORKERS=4``); the environment wins over the given config.
    """

    env_prefix = "KVCORE_TRANSFER_"

    layout: CacheLayout
    max_model_len: int = Field(gt=0, description="longest sequence in tokens: sizes staging")
    num_host_blocks: int = Field(default=0, ge=0, description="host (swap) cache blocks; 0: none")
    rank: int = Field(default=0, ge=0)
    world_size: int = Field(default=1, ge=1)
    namespace: str = Field(default="default", min_length=1)
    device_id: int = Field(default=0, ge=0)

    write_policy: Literal["write_through", "selective"] = "write_through"
    selective_min_hits: int = Field(
        default=2, ge=1, description="selective: write a block once it has been used this often"
    )
    hit_table_size: int = Field(default=1_000_000, ge=1, description="keys whose hits are tracked")

    swap_workers: int = Field(default=1, ge=1)
    read_workers: int = Field(default=2, ge=1)
    write_workers: int = Field(default=2, ge=1)
    queue_depth: int = Field(default=64, ge=1, description="tasks waiting per direction")
    submit_wait_s: float = Field(default=1.0, ge=0, description="back-pressure wait when full")
    staging_buffers: int | None = Field(
        default=None, ge=1, description="staging buffers per direction (default: workers + 1)"
    )
    pipeline_blocks: int = Field(
        default=16,
        ge=1,
        description="blocks per span: storage I/O of one span overlaps the "
        "device copy of the previous one",
    )
    default_timeout_s: float = Field(default=10.0, gt=0)
    flush_after_read: bool = Field(
        default=True, description="token-index backends: mark restored blocks device-resident"
    )
    strict: bool = Field(default=False, description="let backend exceptions propagate (tests)")

    @model_validator(mode="after")
    def _rank_in_world(self) -> TransferConfig:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        return self

    @property
    def staging_blocks(self) -> int:
        """Blocks one staging buffer holds: the longest request, never allocated per task."""
        return math.ceil(self.max_model_len / self.layout.block_size)

    def staging_count(self, workers: int) -> int:
        return self.staging_buffers or workers + 1
