"""A real ``lmcache server`` (LMCache's MP cache server, on CPU) with the kvcore L2 adapter
over kv_file, driven by LMCache's own vLLM MP adapters (``LMCacheMPWorkerAdapter`` stores and
retrieves a paged KV cache, ``LMCacheMPSchedulerAdapter`` looks up), across a server restart.

The server keeps chunks in its L1 (host memory) and writes them to L2 (kvcore) behind the
store; after a restart its L1 is empty, so every hit is read back from the kv_file store.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from kvcore_lmcache import l2_adapter_spec
from kvcore_lmcache.keys import key_fields
from kvcore_lmcache.l2 import PART
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)
from lmcache.v1.multiprocess.group_view import EngineGroupInfo

import kvcore
from kvcore.keys import ObjectName

MODEL = "kvcore-test/tiny"
LAYERS, BLOCKS, BLOCK, HEADS, HEAD_DIM = 4, 64, 16, 2, 64
CHUNK = 64  # tokens per LMCache chunk: 4 blocks
TOKENS = list(range(1000, 1256))  # 4 chunks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One ``lmcache server`` process on 127.0.0.1 (restartable on the same ports)."""

    def __init__(self, root: Path, log: Path) -> None:
        self.root = root
        self.log = log
        self.port = _free_port()
        self.http_port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> None:
        spec = l2_adapter_spec("file", backend_config={"root": str(self.root)})
        lmcache = Path(sys.executable).with_name("lmcache")
        env = dict(os.environ, LMCACHE_DISABLE_BANNER="1", LMCACHE_TRACK_USAGE="false")
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    str(lmcache), "server",
                    "--host", "127.0.0.1", "--port", str(self.port),
                    "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                    "--chunk-size", str(CHUNK),
                    "--l1-size-gb", "0.05", "--eviction-policy", "LRU",
                    "--supported-transfer-mode", "engine_driven",
                    "--disable-metrics",
                    "--l2-adapter", json.dumps(spec),
                ],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _strategy() -> ParallelStrategy:
    return ParallelStrategy(
        mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1
    )


def _until(server: Server, what: str, fn: Any, timeout: float = 90.0) -> Any:
    """``fn()``'s first result that is not None (retrying what raises while the server
    starts), failing with the server's log if it dies or time runs out."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not server.alive():
            pytest.fail(f"lmcache server died while waiting for {what}:\n{_tail(server.log)}")
        try:
            got = fn()
        except (ConnectionError, TimeoutError) as exc:
            got, last = None, exc
        if got is not None:
            return got
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what} ({last}):\n{_tail(server.log)}")


def _tail(log: Path, n: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def _worker(server: Server, ctx: zmq.Context, kv: dict[str, torch.Tensor]) -> Any:
    def register() -> Any:
        worker = LMCacheMPWorkerAdapter(server.url, ctx, MODEL, BLOCK, _strategy(), mq_timeout=5)
        worker.register_kv_caches(
            kv, [EngineGroupInfo(0, tuple(range(LAYERS)), BLOCK)], {"kv_layout": "NHD"}
        )
        return worker

    return _until(server, "the worker's registration", register)


def _finished(server: Server, worker: Any, request_id: str, kind: str) -> None:
    def done() -> bool | None:
        stored, retrieved = worker.get_finished({request_id})
        got = stored if kind == "store" else retrieved
        return True if got and request_id in got else None

    _until(server, f"{kind} of {request_id}", done)


def _lookup(server: Server, scheduler: Any, request_id: str, salt: str = "") -> int:
    scheduler.maybe_submit_lookup_request(request_id, TOKENS, cache_salt=salt)
    return int(
        _until(server, f"lookup {request_id}", lambda: scheduler.check_lookup_result(request_id))
    )


def _stored_keys(root: Path) -> list[Any]:
    with kvcore.BackendHandle("file", {"root": str(root)}, context={"namespace": "lmcache"}) as h:
        names = h.open().names()
    keys = []
    for name in names:
        ident = ObjectName.parse(name)
        if ident is not None and ident.namespace == "lmcache" and ident.part == PART:
            keys.append(key_fields(ident.block_key))
    return keys


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path / "store", tmp_path / "server.log")
    yield srv
    srv.stop()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    """The adapters' ZeroMQ context, destroyed with linger 0 when the test ends. Left to the
    garbage collector, its ``__del__`` closes the sockets with their default linger (forever)
    and waits for their unsent messages: a registration attempt made while the server was
    starting holds one that will never go out, and a later test hung there (in CI, at a
    collection inside another test's setup)."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_a_restarted_server_serves_its_stored_chunks_byte_for_byte_from_kv_file(server, ctx):
    gen = torch.Generator().manual_seed(0)
    kv = {
        f"layer.{i}": torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD_DIM, generator=gen).half()
        for i in range(LAYERS)
    }
    server.start()
    writer = _worker(server, ctx, kv)
    op = LoadStoreOp(token_ids=TOKENS, block_ids=[list(range(16))], start=0, end=len(TOKENS))
    writer.submit_store_request("store-1", op, None)
    _finished(server, writer, "store-1", "store")
    # the server writes to L2 behind the store: wait for the 4 chunks in kv_file
    _until(
        server, "4 chunks in kv_file", lambda: True if len(_stored_keys(server.root)) >= 4 else None
    )
    writer.shutdown()
    server.stop()

    keys = _stored_keys(server.root)
    assert len(keys) == 4
    assert {(k.model_name, k.salt_id, k.object_group_id) for k in keys} == {(MODEL, "", 0)}
    assert {k.kv_rank for k in keys} == {(1 << 24) | (1 << 8)}  # world 1, rank 0, local 1/0

    server.start()  # an empty L1: every hit below comes from kv_file
    restored = {name: torch.zeros_like(t) for name, t in kv.items()}
    reader = _worker(server, ctx, restored)
    scheduler = _until(
        server,
        "the scheduler adapter",
        lambda: LMCacheMPSchedulerAdapter(
            [server.url], ctx, MODEL, BLOCK, _strategy(), mq_timeout=5
        ),
    )
    assert _lookup(server, scheduler, "other-tenant", salt="tenant-b") == 0
    assert _lookup(server, scheduler, "load-1") == len(TOKENS)
    into = LoadStoreOp(token_ids=TOKENS, block_ids=[list(range(16, 32))], start=0, end=len(TOKENS))
    reader.submit_retrieve_request("load-1", into, None)
    _finished(server, reader, "load-1", "retrieve")
    assert reader.get_block_ids_with_load_errors() == set()
    for name in kv:
        assert torch.equal(restored[name][:, 16:32], kv[name][:, 0:16]), name
        assert torch.count_nonzero(restored[name][:, :16]) == 0
    reader.shutdown()
    scheduler.shutdown()
