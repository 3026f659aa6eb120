"""Settings of the file backend; every field can be overridden with ``KVCORE_FILE_<FIELD>``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

import kvcore
from kvcore.config import check_namespace
from kvcore.schemas import interval_field
from kvcore.tenants import TenantSettings

__all__ = ["FileConfig", "check_root", "default_root", "safe_namespace"]


def default_root() -> str:
    """``$XDG_CACHE_HOME/kvcore``, else ``~/.cache/kvcore``: works with no settings at all."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "kvcore")


def check_root(root: Path) -> None:
    """Refuse a root that can never hold a store, in one line that says why: it is a file,
    or lies under one. (Whether it can be created is known only by creating it: the backend
    reports that, naming ``root`` too.)"""
    if root.exists() or root.is_symlink():
        if not root.is_dir():
            raise ValueError(f"{str(root)!r} is {_kind(root)}, not a directory")
        return
    for parent in root.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(
                    f"{str(root)!r} lies under {str(parent)!r}, which is {_kind(parent)}"
                )
            return


def _kind(path: Path) -> str:
    if path.is_symlink() and not path.exists():
        return "a dangling symlink"
    if path.is_file():
        return "a regular file"
    return "not a directory (a device, a FIFO or a socket)"


def safe_namespace(value: str, field: str = "namespace") -> str:
    """A namespace becomes one directory name, so it must not be able to leave the root:
    kvcore's one rule for namespaces (:func:`kvcore.config.check_namespace`) is this one."""
    try:
        return check_namespace(value, field)
    except ValueError as exc:
        raise ValueError(f"{exc} (it names a directory under the root)") from None


class FileConfig(kvcore.BackendConfig):
    env_prefix = "KVCORE_FILE_"

    root: str = Field(default_factory=default_root, description="directory holding the store")
    namespace: str = Field(
        default="", description="subdirectory of root; empty: the engine context's namespace"
    )
    capacity_bytes: kvcore.ByteSize = Field(
        default=kvcore.ByteSize(16 * 2**30),
        gt=0,
        description="bytes kept on disk, headers included: an int, or a string such as "
        "'64GiB' (binary) or '500GB' (decimal)",
    )
    fsync: Literal["none", "data", "data_and_dir"] = Field(
        default="none",
        description="none: rely on checksums (a torn file is a miss); data: fdatasync each "
        "object before it counts; data_and_dir: also fsync the directories after the renames",
    )
    high_watermark: float = Field(
        default=0.95, gt=0, le=1, description="evict when a write would pass this fraction"
    )
    low_watermark: float = Field(default=0.85, gt=0, le=1, description="evict down to this")
    admission: Literal["all", "second-hit", "adaptive"] = Field(
        default="adaptive",
        description="which offered blocks a full store writes (eviction stays LRU): all; "
        "second-hit (the second time a block is offered); adaptive (follows whichever of the "
        "two would have hit more recently, from small simulations of both; admits everything "
        "while the store has room). See kvcore.admission",
    )
    admission_doorkeeper: float = Field(
        default=2.0,
        ge=1 / 64,
        le=64,
        description="second-hit and adaptive remember this many times the store's capacity "
        "in blocks of recently offered block ids",
    )
    admission_sample_rate: float = Field(
        default=1 / 16,
        ge=1 / 4096,
        le=1,
        description="adaptive: the fraction of block ids its simulations follow",
    )
    io_threads: int = Field(
        default_factory=lambda: min(32, max(16, 2 * (os.cpu_count() or 1))),
        ge=1,
        le=256,
        description="objects of one batch in flight at once; copies and checksums are "
        "further limited to the usable cores, so threads beyond them only wait on the disk",
    )
    direct_reads: bool = Field(
        default=True,
        description="read objects the page cache does not hold with O_DIRECT (page-aligned "
        "buffers only); false: always read through the page cache",
    )
    rescan_interval_s: float = interval_field(
        30.0,
        "seconds between full scans of the directory (one process of those sharing it scans; "
        "a scan adopts files no process recorded and frees the reservations of processes "
        "that died) and between saves of read recency to file mtimes (0: never; recency is "
        "then saved at close)",
    )

    tenants: TenantSettings | None = Field(
        default=None,
        description="tenants' shares of the store (kvcore.tenants.TenantSettings): each "
        "tenant's reserved_bytes (no other tenant's write evicts them) and quota_bytes (the "
        "most it holds); every process sharing the root should set the same. None: one LRU "
        "for every tenant (bytes held are still counted per tenant)",
    )

    @field_validator("root")
    @classmethod
    def _root(cls, value: str) -> str:
        if not value or "\x00" in value:
            raise ValueError("root must be a non-empty path without NUL")
        root = Path(value).expanduser()
        check_root(root)
        return str(root)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        return value and safe_namespace(value)

    @model_validator(mode="after")
    def _watermarks(self) -> FileConfig:
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark {self.low_watermark} must be <= high_watermark "
                f"{self.high_watermark}"
            )
        if self.tenants is not None:
            self.tenants.check_capacity(int(self.capacity_bytes), "tenants")
        return self
