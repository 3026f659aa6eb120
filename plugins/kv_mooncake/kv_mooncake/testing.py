"""A real Mooncake cluster on loopback for tests, and pytest fixtures around it.

This module is a pytest plugin, loaded automatically through the ``pytest11`` entry point of
the ``kvcore-mooncake`` distribution, so any test in an environment where the plugin is
installed can use:

- ``mooncake_cluster`` (session): a ``mooncake_master`` on 127.0.0.1 with free ports plus a
  storage node (a client that contributes ``storage_bytes`` of memory and lives for the
  whole session);
- ``mooncake_config`` (function): a backend config dict pointing at that cluster;
- ``mooncake_cluster_factory`` (function): start private clusters (to kill, pause or fill
  them), stopped at the end of the test.

Why a storage node: Mooncake keeps an object in the memory of the client that contributed
the segment it landed in, and drops it when that client closes. Test backends therefore
contribute nothing (``global_segment_size=0``) and store into the storage node, so closing one
test's backend never loses another test's data.

Importing this module imports neither Mooncake nor starts anything.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "MooncakeCluster",
    "MooncakeMaster",
    "StorageNode",
    "find_master_binary",
    "free_port",
    "isolate_loopback",
    "shape_loopback",
]

LOOPBACK = "127.0.0.1"
_started: list[MooncakeMaster] = []


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` has open (its /proc fd links)."""
    out: set[int] = set()
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):
            target = os.readlink(f"{fds}/{fd}")
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    return out


def _listening_inodes(port: int) -> set[int]:
    """The inodes of the TCP sockets listening on ``port`` in this network namespace."""
    out: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            next(f, None)  # the header
            for line in f:
                fields = line.split()
                listening = len(fields) > 9 and fields[3] == "0A"  # TCP_LISTEN
                if listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    out.add(int(fields[9]))
    return out


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (True where /proc cannot tell)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread exited
        if stat.rsplit(")", 1)[1].split()[0] not in ("T", "t", "Z", "X"):  # stopped or dead
            return False
    return True


def find_master_binary() -> str:
    """``mooncake_master``: $KV_MOONCAKE_MASTER_BIN, beside this Python, on PATH, or in the wheel."""
    candidates = [
        os.environ.get("KV_MOONCAKE_MASTER_BIN"),
        str(Path(sys.executable).with_name("mooncake_master")),
        shutil.which("mooncake_master"),
    ]
    with contextlib.suppress(ImportError):
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
        if spec is not None and spec.submodule_search_locations:
            candidates += [
                str(Path(p) / "mooncake_master") for p in spec.submodule_search_locations
            ]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        "mooncake_master not found; pip install mooncake-transfer-engine-non-cuda or set "
        "KV_MOONCAKE_MASTER_BIN"
    )


class MooncakeMaster:
    """One ``mooncake_master`` process listening on 127.0.0.1 only."""

    def __init__(self, *, extra_args: tuple[str, ...] = (), ready_timeout_s: float = 15.0):
        self.extra_args = extra_args
        self.ready_timeout_s = ready_timeout_s
        self.rpc_port = 0
        self.metrics_port = 0
        self.process: subprocess.Popen[bytes] | None = None
        # kept open for the master's lifetime (restarts append to it); closed by close()
        self._log = tempfile.NamedTemporaryFile(prefix="mooncake-master-", suffix=".log")  # noqa: SIM115

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def health_url(self) -> str:
        return f"http://{LOOPBACK}:{self.metrics_port}/health"

    def start(self) -> MooncakeMaster:
        """Start (or restart on the same ports) and wait until /health says ready."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("mooncake_master is already running")
        fresh = self.rpc_port == 0
        for _ in range(3 if fresh else 1):
            if fresh:
                self.rpc_port, self.metrics_port = free_port(), free_port()
            self.process = subprocess.Popen(
                [
                    find_master_binary(),
                    f"--rpc_address={LOOPBACK}",
                    f"--rpc_port={self.rpc_port}",
                    f"--metrics_host={LOOPBACK}",
                    f"--metrics_port={self.metrics_port}",
                    "--logtostderr",
                    *self.extra_args,
                ],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the test run is ours to handle
            )
            if self._wait_ready():
                if self not in _started:
                    _started.append(self)
                return self
        raise RuntimeError(f"mooncake_master did not become ready; its log:\n{self.log_tail()}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.ready_timeout_s
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False  # e.g. a port taken between free_port() and bind
            with (
                contextlib.suppress(OSError, ValueError),
                opener.open(self.health_url, timeout=0.5) as response,
            ):
                if json.loads(response.read()).get("service_ready"):
                    owns = self._owns_ports()
                    if owns:
                        return True
                    if owns is False:
                        # another process took a port between free_port() and the master's
                        # bind (a master of a test running beside this one): the health that
                        # answered is that master's, and this one is not reachable there
                        self.kill()
                        return False
                    # (None: a port has no listener yet. The master reports ready before its
                    # RPC server listens, and on a loaded machine that took long enough for
                    # three masters in a row to be killed as if their ports were taken)
            time.sleep(0.05)
        self.kill()
        return False

    def _owns_ports(self) -> bool | None:
        """Whether this master's process is what listens on its RPC and metrics ports (True
        where /proc cannot tell); None while a port has no listener at all (not yet bound)."""
        assert self.process is not None
        try:
            mine = _socket_inodes(self.process.pid)
            listening = {
                port: _listening_inodes(port) for port in (self.rpc_port, self.metrics_port)
            }
        except OSError:
            return True
        if any(inodes and not inodes & mine for inodes in listening.values()):
            return False  # another process listens there
        if not all(listening.values()):
            return None
        return True

    def capacity_bytes(self) -> int:
        """The memory every client has mounted into the store, as the master counts it
        (``master_total_capacity_bytes`` of its metrics endpoint)."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        url = f"http://{LOOPBACK}:{self.metrics_port}/metrics"
        with opener.open(url, timeout=2.0) as response:
            text = response.read().decode()
        for line in text.splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return int(float(line.split()[1]))
        raise RuntimeError(f"the master's metrics have no master_total_capacity_bytes:\n{text}")

    def log_tail(self, n: int = 40) -> str:
        lines = Path(self._log.name).read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 5 s."""
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # a paused master cannot exit
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def kill(self) -> None:
        """SIGKILL: the master dies as in a crash."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def pause(self) -> None:
        """SIGSTOP: the master hangs (connections stay open, nothing answers). Returns once
        every thread of it has stopped: a stop is delivered to each thread when it next runs,
        and on a busy machine a thread not yet stopped answered requests sent after the
        signal (11 of 200 pauses here)."""
        if self.process is None:
            return
        self.process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 30.0
        while not _all_threads_stopped(self.process.pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master (pid {self.process.pid}) did not stop")
            time.sleep(0.001)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        self._log.close()
        with contextlib.suppress(ValueError):
            _started.remove(self)


class StorageNode:
    """An in-process Mooncake client that contributes memory and holds objects for others."""

    def __init__(self, master: MooncakeMaster, nbytes: int) -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        from kv_mooncake.connect import import_store_class

        self.nbytes = nbytes
        self.store = import_store_class()()
        code = self.store.setup(
            LOOPBACK, "P2PHANDSHAKE", nbytes, 16 << 20, "tcp", "", master.address
        )
        if code != 0:
            raise RuntimeError(f"storage node setup failed with code {code}")

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


class MooncakeCluster:
    """A master plus a storage node, both on loopback. Use as a context manager."""

    def __init__(self, *, storage_bytes: int = 512 << 20, master_args: tuple[str, ...] = ()):
        self.storage_bytes = storage_bytes
        self.master = MooncakeMaster(extra_args=master_args)
        self.storage: StorageNode | None = None

    def start(self) -> MooncakeCluster:
        self.master.start()
        if self.storage_bytes:
            try:
                self.storage = StorageNode(self.master, self.storage_bytes)
            except BaseException:
                self.master.close()
                raise
        return self

    def config(self, **overrides: Any) -> dict[str, Any]:
        """A ``mooncake`` backend config for a client of this cluster that stores nothing itself."""
        return {
            "master_server_address": self.master.address,
            "master_metrics_port": self.master.metrics_port,
            "local_hostname": LOOPBACK,
            "protocol": "tcp",
            "global_segment_size": 0,
            "local_buffer_size": 16 << 20,
            "connect_timeout_s": 2.0,
            **overrides,
        }

    def close(self) -> None:
        try:
            if self.storage is not None:
                self.storage.close()
        finally:
            self.storage = None
            self.master.close()

    def __enter__(self) -> MooncakeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def isolate_loopback() -> str | None:
    """Move this process into a private network namespace that has only loopback.

    Mooncake's client opens its handshake and data listeners on the wildcard address (only
    the address it advertises follows ``MC_TCP_BIND_ADDRESS``). Inside a private namespace
    the wildcard reaches loopback and nothing else. Needs root (CAP_SYS_ADMIN) and must run
    before the process starts Python threads or opens connections. Returns None on success,
    else why it did not.
    """
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if os.geteuid() != 0:
        return "not root"
    # unshare() moves only the calling thread; later threads and children follow it. Native
    # worker threads (OpenBLAS) do no networking, but another Python thread might.
    if threading.active_count() > 1:
        return "the process already runs Python threads"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
        return f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, 0x8913, request))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sh22x", b"lo", flags | 0x1))  # SIOCSIFFLAGS, IFF_UP
    return None


def shape_loopback(
    rate: str | None, *, burst: str = "256kb", latency: str = "50ms", change: bool = False
) -> None:
    """Shape this network namespace's ``lo`` with tc's token bucket filter to ``rate`` (e.g.
    ``"490mbit"``; None: unshaped). ``change``: alter the running qdisc in place (a link that
    slows down under a transfer). Use after :func:`isolate_loopback` only: it shapes whatever
    ``lo`` the process sees."""
    if change and rate is not None:
        cmd = ["tc", "qdisc", "change", "dev", "lo", "root", "tbf", "rate", rate]
        subprocess.run([*cmd, "burst", burst, "latency", latency], check=False)
        return
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, check=False)
    if rate is not None:
        cmd = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate]
        subprocess.run([*cmd, "burst", burst, "latency", latency], check=True)


@atexit.register
def _stop_leftover_masters() -> None:
    """A test run that dies early must not leave masters behind."""
    for master in list(_started):
        with contextlib.suppress(Exception):
            master.stop()


# -- pytest fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def mooncake_cluster() -> Iterator[MooncakeCluster]:
    """A master and a 512 MiB storage node on loopback, shared by the whole session."""
    with MooncakeCluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def mooncake_master(mooncake_cluster: MooncakeCluster) -> MooncakeMaster:
    """The session cluster's master (address, health_url, ports)."""
    return mooncake_cluster.master


@pytest.fixture
def mooncake_config(mooncake_cluster: MooncakeCluster) -> dict[str, Any]:
    """Backend config for the session cluster: ``open_backend("mooncake", mooncake_config)``."""
    return mooncake_cluster.config()


@pytest.fixture
def mooncake_cluster_factory() -> Iterator[Callable[..., MooncakeCluster]]:
    """``factory(storage_bytes=..., master_args=...)`` -> a private, started cluster."""
    clusters: list[MooncakeCluster] = []

    def factory(**kwargs: Any) -> MooncakeCluster:
        cluster = MooncakeCluster(**kwargs).start()
        clusters.append(cluster)
        return cluster

    yield factory
    for cluster in reversed(clusters):
        cluster.close()
