"""``capacity_bytes`` bounds what the store holds on its file system, its own files (journal,
ledger, directories) and the writes in flight included: measured with ``statvfs`` of a tmpfs
of the test's own (a private mount namespace), sampled every millisecond by another process,
while writers fill the store far past its capacity. Not the index's count: the file system's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = str(Path(__file__).with_name("kv_file_bound.py"))
#: 2 x 4 KiB parts and a 4 KiB header each: 16 KiB a block on the file system
BLOCK_ON_DISK = 16 << 10
BOUND = 1.05


def _private_tmpfs_command(mount: Path, *args: object) -> list[str] | None:
    """A command running the driver on a fresh tmpfs at ``mount`` that only it sees, or None
    where this process may not make one (no ``unshare``, no privilege for mount namespaces)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    mount.mkdir()
    script = 'mount -t tmpfs -o size=256m,mode=0700 kvcore-bound "$1" && shift && exec "$@"'
    probe = subprocess.run([unshare, "-m", "--propagation", "private", "sh", "-c", script, "sh",
                            str(mount), "true"], capture_output=True)  # fmt: skip
    if probe.returncode != 0:
        return None
    return [unshare, "-m", "--propagation", "private", "sh", "-c", script, "sh", str(mount),
            sys.executable, DRIVER, str(mount), *map(str, args)]  # fmt: skip


@pytest.mark.parametrize(
    ("capacity", "processes", "threads", "high"),
    [
        (2 << 20, 4, 1, 1.0),  # 4 processes share a small root at a full high watermark
        (2 << 20, 4, 1, 0.95),  # the default watermarks
        (2 << 20, 1, 4, 1.0),  # one process, 4 writer threads
        (256 << 10, 4, 1, 1.0),  # a root of 16 blocks
        (32 << 20, 4, 1, 1.0),  # the journal's share settles at its long-run size
    ],
    ids=[
        "2MiB-4proc-hw1",
        "2MiB-4proc-default",
        "2MiB-4threads-hw1",
        "256KiB-4proc-hw1",
        "32MiB-4proc-hw1",
    ],
)
def test_bytes_on_the_file_system_stay_within_the_capacity(
    tmp_path, capacity: int, processes: int, threads: int, high: float
) -> None:
    # 4 s of writes at least, and past them until the writers have written 6x the capacity:
    # the work this test needs, not what a machine manages in a fixed time (a busy one wrote
    # too little in 4 s)
    min_blocks = -(-6 * capacity // (BLOCK_ON_DISK * processes))
    command = _private_tmpfs_command(
        tmp_path / "mnt", capacity, processes, threads, 4.0, high, min_blocks
    )
    if command is None:
        pytest.skip("no private tmpfs here (unshare -m and mount need CAP_SYS_ADMIN)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    peak = got["peak"] - got["before"]
    print(f"capacity {capacity}: peak {peak / capacity:.4f}x over {got['samples']} samples, "
          f"{(got['after'] - got['before']) / capacity:.4f}x after, "
          f"{got['written']} blocks written, {got['refused']} refused")  # fmt: skip
    assert got["samples"] > 1000
    assert got["written"] * BLOCK_ON_DISK > 5 * capacity, "the writers never filled the store"
    assert peak <= BOUND * capacity, f"peak {peak / capacity:.4f}x the capacity on the tmpfs"
    if capacity >= 2 << 20:  # room for every writer's batch: the store's own files starve none
        assert got["refused"] == 0
