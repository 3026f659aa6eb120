"""The ``mooncake`` kvcore backend: blocks as objects in a Mooncake Store cluster.

- Query: one ``batch_is_exist`` over every object of the request (K, V and scales).
- Write: the same existence check first. It lets the write skip objects already stored
  (names are content-derived, and Mooncake keeps the old value on a repeated put anyway), and
  it fails at once when the master is down, where a put would stall for seconds. Then
  ``batch_put_from`` for the rest.
- Read: ``batch_get_into``; its per-object answers (bytes read, or -704) give the leading run.

Deadlines: a master RPC ends after ``MC_RPC_TIMEOUT_MS`` at the latest, so a call made with
more time left than that cannot overrun. With less time left, the existence check (also done
before a read then) runs on a helper thread and is abandoned at the deadline; it touches no
caller memory. Data calls are never abandoned, since Mooncake would go on reading or writing
the caller's buffers after we returned; they run in chunks of ``max_batch_bytes`` with the
deadline checked between chunks.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import kvcore
from kv_mooncake.codes import ALREADY_EXISTS, REPLICA_NOT_READY, Counters, reason
from kv_mooncake.config import MooncakeConfig
from kv_mooncake.connect import open_store, prepare_environment
from kv_mooncake.regions import RegionTable
from kv_mooncake.store_keys import store_key
from kvcore import BlockRequest, leading_run

__all__ = ["MooncakeBackend"]

log = logging.getLogger("kv_mooncake")

#: Threads that run existence checks for requests with short deadlines.
PROBE_WORKERS = 4
#: First and longest sleep while waiting for another writer's put to complete.
_READY_POLL_S = 0.001
_READY_POLL_MAX_S = 0.05
#: An inline call is safe when the deadline is further away than this many RPC timeouts.
_INLINE_FACTOR = 1.5


class MooncakeBackend:
    """kvcore backend over ``mooncake.store.MooncakeDistributedStore`` (one client per rank)."""

    config_model = MooncakeConfig
    capabilities = kvcore.Capabilities(
        addressing="key", io="host", persistent=False, shared=True, scales=True
    )

    def __init__(self, config: MooncakeConfig, context: kvcore.BackendContext) -> None:
        self.config = config
        self.context = context
        rpc_timeout_s = prepare_environment(config, context.device_id)
        self._inline_after_s = rpc_timeout_s * _INLINE_FACTOR + 0.1
        self._store: Any = open_store(config, context.device_id)
        from mooncake.store import ReplicateConfig  # importable once open_store succeeded

        self._replicate = ReplicateConfig()
        self._replicate.replica_num = config.replica_num
        self._regions = RegionTable(self._store.register_buffer, self._store.unregister_buffer)
        self._counters = Counters()
        self._probes = ThreadPoolExecutor(PROBE_WORKERS, thread_name_prefix="kv-mooncake-probe")
        self._stuck = 0  # abandoned checks still running: when all workers are, skip the master
        self._stuck_lock = threading.Lock()

    # -- hooks -----------------------------------------------------------------------------

    @kvcore.hookimpl
    def kvcore_query(self, request: BlockRequest) -> int:
        if request.num_blocks == 0:
            return 0
        codes = self._exists(_keys(request), request)
        if codes is None:
            return 0
        return self._present_run(codes, len(request.parts))

    @kvcore.hookimpl
    def kvcore_read(self, request: BlockRequest) -> int:
        if request.num_blocks == 0:
            return 0
        parts = len(request.parts)
        keys = _keys(request)
        ptrs, sizes = _host_regions(request, len(keys))
        m = len(keys)
        if request.time_left() <= self._inline_after_s:
            # a hung master could hold the get past the deadline: ask first, abandonably
            codes = self._exists(keys, request)
            if codes is None:
                return 0
            m = self._present_run(codes, parts) * parts
            if m == 0:
                return 0
        # otherwise the get's own per-object answers (-704 for a miss) end the run
        ok = self._transfer("read", keys[:m], ptrs[:m], sizes[:m], request)
        return leading_run(ok, parts)

    @kvcore.hookimpl
    def kvcore_write(self, request: BlockRequest) -> int:
        if request.num_blocks == 0:
            return 0
        parts = len(request.parts)
        keys = _keys(request)
        ptrs, sizes = _host_regions(request, len(keys))
        codes = self._exists(keys, request)
        if codes is None:
            return 0
        if any(c < 0 for c in codes):
            # the master answered with errors: a put now would only stall, so stop here
            return self._present_run(codes, parts)
        stored = [c == 1 for c in codes]
        todo = [i for i, present in enumerate(stored) if not present]
        self._counters.add("objects_skipped", len(keys) - len(todo))
        if todo:
            ok = self._transfer(
                "write",
                [keys[i] for i in todo],
                [ptrs[i] for i in todo],
                [sizes[i] for i in todo],
                request,
            )
            for i, good in zip(todo, ok, strict=True):
                stored[i] = good
        return leading_run(stored, parts)

    @kvcore.hookimpl
    def kvcore_register_buffer(self, ptr: int, nbytes: int) -> None:
        code = self._regions.add(ptr, nbytes)
        if code != 0:
            # not fatal: requests in this region fall back to temporary registration
            self._counters.add("register_failed")
            log.warning(
                "mooncake: registering %d bytes at %#x failed with code %d (%s)",
                nbytes,
                ptr,
                code,
                reason(code),
            )

    @kvcore.hookimpl
    def kvcore_unregister_buffer(self, ptr: int) -> None:
        if self._regions.remove(ptr) != 0:
            log.debug("mooncake: no registered region starts at %#x", ptr)

    @kvcore.hookimpl
    def kvcore_stats(self) -> dict[str, float]:
        stats = self._counters.snapshot()
        stats["registered_regions"] = float(self._regions.count)
        return stats

    @kvcore.hookimpl
    def kvcore_raw_baseline(self, ptr: int, nbytes: int, object_nbytes: int) -> dict[str, float]:
        """The raw client on the same bytes: one batch_put_from and one batch_get_into."""
        n = max(1, nbytes // object_nbytes)
        tag = uuid.uuid4().hex
        keys = [f"kvcore-raw-baseline-{tag}-{i}" for i in range(n)]
        ptrs = [ptr + i * object_nbytes for i in range(n)]
        sizes = [object_nbytes] * n
        pinned, _ = self._regions.pin([(ptr, ptr + n * object_nbytes)])
        try:
            t0 = time.perf_counter()
            put = self._store.batch_put_from(keys, ptrs, sizes)
            t1 = time.perf_counter()
            got = self._store.batch_get_into(keys, ptrs, sizes)
            t2 = time.perf_counter()
        finally:
            self._regions.unpin(pinned)
            for key in keys:  # leave nothing behind in the cluster
                self._store.remove(key, True)
        gib = n * object_nbytes / 2**30
        out: dict[str, float] = {}
        if all(c == 0 for c in put):
            out["write_gbps"] = gib / (t1 - t0)
        if all(c == object_nbytes for c in got):
            out["read_gbps"] = gib / (t2 - t1)
        return out

    @kvcore.hookimpl
    def kvcore_close(self) -> None:
        store, self._store = self._store, None
        if store is None:
            return
        self._regions.clear()
        _close_store(store, self._probes, self.config.close_timeout_s)

    # -- Mooncake calls ----------------------------------------------------------------------

    @property
    def store(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (for benchmarks and diagnostics)."""
        return self._store

    def _exists(self, keys: list[str], request: BlockRequest) -> list[int] | None:
        """``batch_is_exist`` codes, or None when the deadline passed first (counted)."""
        left = request.time_left()
        if left <= 0:
            self._counters.add("miss_deadline")
            return None
        if left > self._inline_after_s:  # Mooncake's RPC timeout ends the call in time
            return list(self._store.batch_is_exist(keys))
        with self._stuck_lock:
            if self._stuck >= PROBE_WORKERS:
                self._counters.add("miss_master_unresponsive")
                return None
        future = self._probes.submit(self._store.batch_is_exist, keys)
        try:
            return list(future.result(timeout=left))
        except FutureTimeout:
            self._counters.add("miss_deadline")
            if not future.cancel():
                with self._stuck_lock:
                    self._stuck += 1
                future.add_done_callback(self._unstick)
            return None

    def _unstick(self, _future: object) -> None:
        with self._stuck_lock:
            self._stuck -= 1

    def _get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> tuple[list[int], int]:
        """Read into the regions; a key is done when exactly its region's size arrived."""
        results = self._store.batch_get_into(keys, ptrs, sizes)
        done = [r if r == s else (r if r < 0 else 0) for r, s in zip(results, sizes, strict=True)]
        return done, sum(s for r, s in zip(results, sizes, strict=True) if r == s)

    def _put(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> tuple[list[int], int]:
        results = self._store.batch_put_from(keys, ptrs, sizes, config=self._replicate)
        # -705: another writer stored the same name (hence the same bytes) first
        done = [1 if r in (0, ALREADY_EXISTS) else r for r in results]
        return done, sum(s for r, s in zip(results, sizes, strict=True) if r == 0)

    def _transfer(
        self,
        op: str,
        keys: list[str],
        ptrs: list[int],
        sizes: list[int],
        request: BlockRequest,
    ) -> list[bool]:
        """Read or write chunk by chunk; per key whether it succeeded (False after a stop)."""
        ok = [False] * len(keys)
        pinned, unregistered = self._regions.pin(
            (p, p + s) for p, s in zip(ptrs, sizes, strict=True)
        )
        self._counters.add("unregistered_spans", unregistered)
        try:
            for lo, hi in _chunks(sizes, self.config.max_batch_bytes):
                if lo and request.expired():
                    self._counters.add("miss_deadline")
                    break
                if not self._transfer_chunk(op, keys, ptrs, sizes, lo, hi, ok, request):
                    break
        finally:
            self._regions.unpin(pinned)
        return ok

    def _transfer_chunk(
        self,
        op: str,
        keys: list[str],
        ptrs: list[int],
        sizes: list[int],
        lo: int,
        hi: int,
        ok: list[bool],
        request: BlockRequest,
    ) -> bool:
        """Move keys ``[lo, hi)``, filling ``ok``; False when one failed (reason counted).

        A read that finds an object whose put is still in flight (another writer's: the
        existence check already counts it) waits for it, with backoff, until the deadline.
        """
        call = self._get if op == "read" else self._put
        backoff = _READY_POLL_S
        while True:
            codes, nbytes = call(keys[lo:hi], ptrs[lo:hi], sizes[lo:hi])
            self._counters.add(f"bytes_{op}", nbytes)
            good = [c > 0 for c in codes]
            ok[lo:hi] = good
            if all(good):
                return True
            first = good.index(False)
            code = codes[first]
            if code == REPLICA_NOT_READY and request.time_left() > backoff:
                self._counters.add("waits_replica_not_ready")
                time.sleep(backoff)
                backoff = min(backoff * 2, _READY_POLL_MAX_S)
                lo += first  # keys before it are done
                continue
            self._counters.add(f"miss_{reason(code) if code < 0 else 'size_mismatch'}")
            return False

    def _present_run(self, codes: Sequence[int], parts: int) -> int:
        """Leading blocks whose objects all exist; counts why the run ended."""
        n = leading_run(codes, parts)
        if n * parts < len(codes):
            first = next(c for c in codes[n * parts :] if c != 1)
            self._counters.add(f"miss_{reason(first) if first < 0 else 'not_found'}")
        return n


def _keys(request: BlockRequest) -> list[str]:
    parts = len(request.parts)
    keys = []
    for i, names in enumerate(request.object_names):
        if len(names) != parts:
            raise ValueError(
                f"request.object_names[{i}] has {len(names)} names for {parts} parts "
                f"{request.parts}"
            )
        keys.extend(store_key(name) for name in names)
    return keys


def _host_regions(request: BlockRequest, n_keys: int) -> tuple[list[int], list[int]]:
    host = request.host
    if host is None:
        raise ValueError("request.host is None: the mooncake backend reads and writes host memory")
    ptrs, sizes = host.flat()
    if len(ptrs) != n_keys or len(host.nbytes) != len(request.parts):
        raise ValueError(
            f"request.host has {len(host.ptrs)} blocks x {len(host.nbytes)} parts of regions "
            f"for {request.num_blocks} blocks x {len(request.parts)} parts of object names"
        )
    return ptrs, sizes


def _chunks(sizes: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` index ranges of about ``budget`` bytes each (at least one key each)."""
    chunks = []
    lo = total = 0
    for i, size in enumerate(sizes):
        total += size
        if total >= budget:
            chunks.append((lo, i + 1))
            lo, total = i + 1, 0
    if lo < len(sizes):
        chunks.append((lo, len(sizes)))
    return chunks


# -- closing ----------------------------------------------------------------------------------

_closing: list[threading.Thread] = []
_CLOSE_AT_EXIT_S = 30.0


def _close_store(store: Any, probes: ThreadPoolExecutor, wait_s: float) -> None:
    """Close a client, waiting at most ``wait_s`` (it takes 1-3 s, ~20 s after the master
    died); the rest happens on a thread that interpreter exit waits for."""
    thread = threading.Thread(target=_quiet_close, args=(store, probes), name="kv-mooncake-close")
    thread.daemon = True
    thread.start()
    thread.join(wait_s)
    if thread.is_alive():
        _closing[:] = [t for t in _closing if t.is_alive()]
        _closing.append(thread)


def _quiet_close(store: Any, probes: ThreadPoolExecutor) -> None:
    # abandoned existence checks may still be inside the client: let them end (each within
    # MC_RPC_TIMEOUT_MS) before the client goes away under them
    probes.shutdown(wait=True, cancel_futures=True)
    try:
        store.close()
    except Exception:  # closing must never raise into the engine
        log.debug("mooncake: client close raised", exc_info=True)


@atexit.register
def _finish_closing() -> None:
    end = time.monotonic() + _CLOSE_AT_EXIT_S
    for thread in _closing:
        thread.join(max(0.0, end - time.monotonic()))
