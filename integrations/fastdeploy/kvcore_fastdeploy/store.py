"""``KVCoreStore``: any key-addressed kvcore backend behind FastDeploy's storage calls.

FastDeploy's cache transfer manager talks to a storage backend through a handful of calls
(``KVCacheStorage`` in ``fastdeploy/cache_manager/transfer_factory/kvcache_storage.py``; their
use in ``cache_transfer_manager.py`` at PaddlePaddle/FastDeploy@1af00818db85f4e844327e9ba5ccfacff1afe9bf):

- ``register_buffer(ptr, size)`` for each pinned staging buffer (lines 416-438);
- ``query(k_keys, v_keys, k_scale_keys, v_scale_keys, timeout) -> int``: the leading run of
  blocks whose objects all exist (lines 784-786, 1014-1016);
- ``batch_get(keys=, target_locations=, target_sizes=) -> list[int]`` and ``batch_set(...)``
  with the keys of all blocks' K objects, then all V objects, then the scales (lines 649-691,
  906-924). FastDeploy reads a block as restored when every one of its objects answered
  ``> 0`` (bytes read), counting from the first block; it ignores ``batch_set``'s answers.

``KVCoreStore`` answers these calls with one kvcore request per call, named by FastDeploy's own
object names (so a kvcore-backed pod and a FastDeploy MooncakeStore pod read each other's
blocks) and pointing into FastDeploy's staging buffers (``[layer, head, block, dim]`` per
object: kvcore's object layout). Per-key answers follow Mooncake's conventions, which
FastDeploy's MooncakeStore passes through: ``batch_get`` gives the bytes read, or
:data:`NOT_FOUND` (-704) for a block past the restored run, or :data:`FAILED` (-1) when the
backend failed rather than missed; ``batch_set`` gives 0 for stored objects, else
:data:`FAILED`. kvcore counts leading runs, so every object of a block past the first miss is
reported as not found even if it happens to exist.

Every call runs through kvcore's one engine-side path (:class:`kvcore.HostRunner`, on
FastDeploy's own thread): ``batch_set`` and ``set`` write what the store's admission policy
admits (kv_file's ``admission``: ``adaptive`` by default), so blocks it does not take are not
written. A refused object is not a failure (nothing went wrong, and nothing should be retried):
it is answered 0, as a stored one, and counted (``host.blocks_refused.write`` in
:meth:`KVCoreStore.stats`, kvcore's name for it under every adapter).

Failures never raise into FastDeploy: a backend error is a counted miss (kvcore's facade), and
only malformed calls (lists of different lengths, sizes that contradict the cache layout)
raise ``ValueError`` naming the argument.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import kvcore
from kvcore import BlockRequest, HostBuffers, Outcome
from kvcore.handles import require_capabilities
from kvcore_fastdeploy.layout import layout_from_fastdeploy
from kvcore_fastdeploy.names import part_of
from kvcore_fastdeploy.settings import FastDeploySettings

__all__ = ["FAILED", "NOT_FOUND", "KVCoreStore", "StoreUnavailable", "store_namespace"]

log = logging.getLogger("kvcore_fastdeploy")

T = TypeVar("T")

#: batch_get's answer for an object of a block past the restored run (Mooncake's OBJECT_NOT_FOUND)
NOT_FOUND = -704
#: the answer for an object the backend failed to read or store
FAILED = -1
#: FastDeploy's MooncakeStore.query default timeout (mooncake_store.py at ecce94cd)
DEFAULT_QUERY_TIMEOUT_S = 1.0

_PART_RUNS = {2: ("k", "v"), 4: ("k", "v", "k_scale", "v_scale")}
_SCALE_DTYPE_BY_SIZE = {4: "float32", 2: "bfloat16"}


def store_namespace(model_id: str, layout: kvcore.CacheLayout, tp_size: int) -> str:
    """The kvcore namespace of a FastDeploy deployment: its model id, its TP degree and its
    cache's format (dtype, block size, heads per rank, head size, layers).

    FastDeploy's object names carry the block hash, the TP *rank* and the weight version, not
    the TP degree or the dtype: a rank-0 object of a TP=2 deployment and of a TP=1 one share a
    name, and so do bfloat16 and float16 blocks of one size. Kept apart here, under one model
    id they are different objects. (Mooncake's ``key_scheme="as_is"``, for sharing objects
    with FastDeploy's own stores, stores the names alone: there FastDeploy's naming rules.)
    """
    fmt = (
        f"tp{int(tp_size)}.{layout.dtype.value}.b{layout.block_size}.h{layout.num_heads}"
        f".d{layout.head_dim}.l{layout.total_layers}"
    )
    return f"{model_id}.{fmt}"


#: what FastDeploy's calls need of a backend: objects found by name, read into host memory
NEEDS = {"addressing": "key", "io": "host"}


class StoreUnavailable(RuntimeError):
    """The backend is not open (it failed to open and is tried again on schedule)."""


class KVCoreStore:
    """FastDeploy's storage interface over one key-addressed, host-I/O kvcore backend.

    Build it with :meth:`open` (what the patched cache transfer manager calls), or wrap an
    already opened :class:`kvcore.Backend`, or a :class:`kvcore.BackendHandle` (opened on
    first use; while it cannot open, every call is a miss or a failure FastDeploy handles,
    and it is tried again on the handle's schedule). Thread-safe as far as the backend is
    (kvcore serialises backends that are not).

    .. versionchanged:: 0.2 a :class:`kvcore.BackendHandle` is accepted.
    """

    def __init__(
        self,
        backend: kvcore.Backend | kvcore.BackendHandle,
        *,
        io_timeout_s: float | None = None,
    ) -> None:
        self._handle: kvcore.BackendHandle | None = None
        self._fixed: kvcore.Backend | None = None
        self._buffers: dict[int, int] = {}  # regions FastDeploy registered: each opened backend's
        self._attached: kvcore.Backend | None = None  # the backend _attach gave the regions
        self._lock = threading.Lock()
        #: every request's tenant (``settings.tenants``' default tenant; None: no tenants)
        self.tenant: str | None = None
        if isinstance(backend, kvcore.BackendHandle):
            self._handle = backend
            config = kvcore.check_backend_config(str(backend.name), backend.config)
            layout = backend.context.layout
            name = backend.label
            backend.add_open_hook(self._attach)
        else:
            self._check(backend)
            self._fixed = backend
            config, layout, name = backend.config, backend.context.layout, backend.name
        self.name = name
        self.layout = layout
        #: deadline of batch_get / batch_set, which take no timeout in FastDeploy's interface
        self.io_timeout_s = config.default_timeout_s if io_timeout_s is None else io_timeout_s
        self._owned = False
        self._counters = kvcore.Counters()
        #: every lookup, read, write and removal (synchronous: FastDeploy's calls are)
        self._runner = kvcore.HostRunner(backend, name="fastdeploy")

    @staticmethod
    def _check(backend: kvcore.Backend) -> None:
        require_capabilities(
            backend, NEEDS, "FastDeploy's batch_get/batch_set (key-addressed, host I/O)"
        )
        layout = backend.context.layout
        if layout is not None and layout.dtype.has_scales and not backend.capabilities.scales:
            raise kvcore.ConfigError(
                f"backend {backend.name!r} cannot store block-wise fp8 scales "
                f"(cache_dtype {layout.dtype.value})"
            )

    def _attach(self, backend: kvcore.Backend) -> None:
        """What each opened backend gets once (the handle's open hook): the checks, and
        FastDeploy's regions."""
        self._check(backend)
        with self._lock:
            for ptr, size in self._buffers.items():
                backend.register_buffer(ptr, size)
            self._attached = backend

    @property
    def backend(self) -> kvcore.Backend:
        """The opened backend. :raises StoreUnavailable: it cannot be opened now."""
        if self._fixed is not None:
            return self._fixed
        assert self._handle is not None
        backend = self._handle.get()
        if backend is None:
            raise StoreUnavailable(f"kvcore backend {self.name!r} is not open")
        return backend

    @classmethod
    def open(
        cls,
        spec: str,
        *,
        namespace: str,
        tp_rank: int,
        tp_size: int,
        device_id: int,
        key_cache_shape: Sequence[int],
        num_layers: int,
        cache_dtype: str,
        num_extra_layers: int = 0,
        scale_dtype: str = "bfloat16",
        scale_item_bytes: int | None = None,
        config: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> KVCoreStore:
        """Open ``kvcore:<name>`` for one rank of a FastDeploy deployment.

        ``namespace`` is FastDeploy's model id (its file store's subdirectory; the store's
        namespace adds the TP degree and the cache's format, see :func:`store_namespace`), the cache
        arguments are the transfer manager's own, and the backend config comes from
        FastDeploy's environment (:func:`fastdeploy_backend_config`) updated by ``config``.
        ``scale_item_bytes`` (FastDeploy's own ``scale_item_bytes``, 4 or 2), when given,
        decides the fp8 scales' size instead of ``scale_dtype``: the object sizes FastDeploy
        passes are computed from it.
        """
        settings = FastDeploySettings.from_environment(
            spec, namespace=namespace, tp_rank=tp_rank, config=config, environ=environ
        )
        if scale_item_bytes is not None:
            scale_dtype = _SCALE_DTYPE_BY_SIZE.get(int(scale_item_bytes), "")
            if not scale_dtype:
                raise ValueError(f"scale_item_bytes {scale_item_bytes!r} must be 4 or 2")
        layout = layout_from_fastdeploy(
            key_cache_shape,
            num_layers,
            cache_dtype,
            num_extra_layers=num_extra_layers,
            scale_dtype=scale_dtype,
        )
        handle = kvcore.BackendHandle(
            settings.backend,
            settings.backend_config,
            requires=NEEDS,
            verify_blocks=settings.verify_blocks,
            retry_s=settings.reopen_interval_s,
            context={
                "layout": layout,
                "rank": tp_rank,
                "world_size": tp_size,
                "device_id": device_id,
                "namespace": store_namespace(namespace, layout, tp_size),
            },
        )
        store = cls(handle)
        store._owned = True
        # FastDeploy's calls carry keys, no request (so no salt): the settings' default tenant,
        # one per engine (None without tenants)
        store.tenant = settings.tenant_of()
        try:
            # now if it can: settings errors raise here; a store that is not up does not stop
            # FastDeploy (logged by the handle; every call is a miss until it opens)
            store.backend  # noqa: B018
        except StoreUnavailable:
            pass
        except BaseException:
            handle.close()
            raise
        log.info(
            "kvcore backend %r serves FastDeploy rank %d/%d (namespace %r, %s)",
            settings.backend,
            tp_rank,
            tp_size,
            namespace,
            layout.dtype.value,
        )
        return store

    # -- FastDeploy's storage calls --------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, buffer_size: int) -> None:
        """A staging region later calls point into (zero-copy transports register it; a
        backend opened later, or reopened, gets it too)."""
        with self._lock:
            self._buffers[int(buffer_ptr)] = int(buffer_size)
            opened = self._attached if self._fixed is None else self._fixed
        if opened is not None:
            opened.register_buffer(int(buffer_ptr), int(buffer_size))

    def query(
        self,
        k_keys: Sequence[str],
        v_keys: Sequence[str],
        k_scale_keys: Sequence[str] | None = None,
        v_scale_keys: Sequence[str] | None = None,
        timeout: float = DEFAULT_QUERY_TIMEOUT_S,
    ) -> int:
        """How many leading blocks have every object (K, V and, when given, both scales)."""
        runs = {"k_keys": k_keys, "v_keys": v_keys}
        if (k_scale_keys is None) != (v_scale_keys is None):
            raise ValueError("k_scale_keys and v_scale_keys: give both or neither")
        if k_scale_keys is not None:
            runs.update(k_scale_keys=k_scale_keys, v_scale_keys=v_scale_keys)
        n = len(k_keys)
        for field, keys in runs.items():
            if len(keys) != n:
                raise ValueError(f"{field} has {len(keys)} keys; k_keys has {n}")
        if n == 0:
            return 0
        parts = _PART_RUNS[len(runs)]
        columns = list(runs.values())
        names = tuple(tuple(col[i] for col in columns) for i in range(n))
        return self._runner.lookup(self._request(names, parts, timeout_s=timeout)).leading

    def batch_get(
        self,
        keys: Sequence[str],
        target_locations: Sequence[int],
        target_sizes: Sequence[int],
    ) -> list[int]:
        """Read each object into its region; per key the bytes read or a negative code."""
        return self._batch("read", keys, target_locations, target_sizes)

    def batch_set(
        self,
        keys: Sequence[str],
        target_locations: Sequence[int],
        target_sizes: Sequence[int],
    ) -> list[int]:
        """Store each object from its region; per key 0 when stored, else a negative code."""
        return self._batch("write", keys, target_locations, target_sizes)

    def get(self, key: str, target_location: int, target_size: int) -> int:
        return self._single("read", key, target_location, target_size)

    def set(self, key: str, target_location: int, target_size: int) -> int:
        return self._single("write", key, target_location, target_size)

    def exists(self, keys: Sequence[str]) -> dict[str, bool]:
        """Whether each object is stored (one query per run of present keys plus each miss)."""
        found: dict[str, bool] = {}
        i = 0
        while i < len(keys):
            rest = keys[i:]
            names = tuple((k,) for k in rest)
            answer = self._runner.lookup(self._request(names, (part_of(rest[0]),)))
            if answer.failure is not None and not answer.requests:  # the store is not open
                return dict.fromkeys(keys, False)
            present = answer.leading
            for k in rest[:present]:
                found[k] = True
            if i + present < len(keys):
                found[keys[i + present]] = False
            i += present + 1
        return found

    def delete(self, key: str, timeout: float | None = None) -> bool:
        """Remove one object; True when it was stored and is gone (``kvcore_remove``)."""
        request = self._request(((key,),), (part_of(key),), timeout_s=timeout)
        return self._runner.remove(request).count > 0

    def clear(self) -> bool:
        """Drop every object of this backend's namespace; False when the backend cannot."""
        try:
            outcome = self.backend.clear()
        except StoreUnavailable:
            return self._unavailable("clear", False)
        if outcome.failure is not None:
            log.warning("kvcore backend %r clear: %s", self.name, outcome.failure)
            return False
        return True

    def close(self) -> None:
        """Close the backend if :meth:`open` opened it."""
        if not self._owned:
            return
        if self._handle is not None:
            self._handle.close()
        elif self._fixed is not None:
            self._fixed.close()

    def stats(self) -> dict[str, float]:
        """kvcore's counters: the runner's (``host.<name>.<op>``, every adapter's one
        vocabulary: blocks the admission policy refused are ``host.blocks_refused.write``,
        calls made while the store was not open ``host.unavailable.<op>``), the backend's
        per call (``blocks_refused.admit``, ...) and the adapter's own, for FastDeploy's
        metrics or a log line. ``blocks_refused`` is the refused count under its 0.1 name,
        until 0.2."""
        opened = self._fixed if self._fixed is not None else self._attached
        own = opened.stats() if opened is not None else {}
        out = {**own, **self._runner.stats(), **self._counters.snapshot()}
        out["blocks_refused"] = out.get("host.blocks_refused.write", 0.0)
        if self._handle is not None:
            out["open_failures"] = float(self._handle.open_failures)
        return out

    def _unavailable(self, op: str, answer: T) -> T:
        """The answer of a call the backend is not open for (counted ``unavailable.<op>``)."""
        self._counters.add(f"unavailable.{op}")
        return answer

    # -- internals -------------------------------------------------------------------------

    def _request(
        self,
        names: tuple[tuple[str, ...], ...],
        parts: tuple[str, ...],
        *,
        host: HostBuffers | None = None,
        timeout_s: float | None = None,
    ) -> BlockRequest:
        timeout = self.io_timeout_s if timeout_s is None else timeout_s
        return BlockRequest(
            task_id=f"fastdeploy-{uuid.uuid4().hex[:12]}",
            # the first name of each block identifies it; FastDeploy's hash is inside it
            block_keys=tuple(row[0] for row in names),
            object_names=names,
            parts=parts,
            deadline=time.monotonic() + timeout,
            host=host,
            tenant=self.tenant,
        )

    def _batch(
        self,
        op: str,
        keys: Sequence[str],
        locations: Sequence[int],
        sizes: Sequence[int],
    ) -> list[int]:
        total = len(keys)
        if len(locations) != total or len(sizes) != total:
            raise ValueError(
                f"keys ({total}), target_locations ({len(locations)}) and target_sizes "
                f"({len(sizes)}) must have the same length"
            )
        if total == 0:
            return []
        parts = self._parts_for(total)
        n = total // len(parts)
        nbytes = []
        for j, part in enumerate(parts):
            run = {int(s) for s in sizes[j * n : (j + 1) * n]}
            if len(run) != 1:
                raise ValueError(
                    f"target_sizes of the {part} objects differ ({sorted(run)}); one size per part"
                )
            size = run.pop()
            if self.layout is not None and size != self.layout.part_bytes(part):
                raise ValueError(
                    f"target_sizes: {part} objects of {size} bytes, but the cache layout's are "
                    f"{self.layout.part_bytes(part)} (check --key_cache_shape, --cache_dtype, "
                    "the layer count and Paddle's default dtype)"
                )
            nbytes.append(size)
        names = tuple(tuple(keys[j * n + i] for j in range(len(parts))) for i in range(n))
        ptrs = tuple(tuple(int(locations[j * n + i]) for j in range(len(parts))) for i in range(n))
        request = self._request(names, parts, host=HostBuffers(ptrs, tuple(nbytes)))
        return self._run(op, request, nbytes)

    def _single(self, op: str, key: str, location: int, size: int) -> int:
        part = part_of(key)
        if self.layout is not None and int(size) != self.layout.part_bytes(part):
            raise ValueError(
                f"target_size: {int(size)} bytes, but the layout's {part} objects are "
                f"{self.layout.part_bytes(part)}"
            )
        request = self._request(
            ((key,),), (part,), host=HostBuffers(((int(location),),), (int(size),))
        )
        return self._run(op, request, [int(size)])[0]

    def _run(self, op: str, request: BlockRequest, nbytes: Sequence[int]) -> list[int]:
        """Read, or write what the store admits; the answers per key in FastDeploy's order."""
        n = request.num_blocks
        if op == "read":
            return _read_answers(self._runner.read(request).outcome, n, nbytes)
        return _write_answers(self._runner.write(request), len(request.parts))

    def _parts_for(self, total: int) -> tuple[str, ...]:
        """The runs a key list holds: K and V, plus both scales when the cache has them."""
        parts = self.layout.parts if self.layout is not None else ("k", "v")
        if total % len(parts):
            raise ValueError(
                f"keys: {total} keys do not split into {len(parts)} equal runs "
                f"({', '.join(parts)}): FastDeploy lists every block's K keys, then V"
                + (", then the K and V scales" if len(parts) == 4 else "")
            )
        return parts


def _read_answers(done: Outcome, n: int, nbytes: Sequence[int]) -> list[int]:
    """``batch_get``'s answers in FastDeploy's key order (part by part): the bytes read for the
    ``done`` leading blocks, :data:`NOT_FOUND` past them (:data:`FAILED` if the backend
    failed)."""
    miss = FAILED if done.failure is not None else NOT_FOUND
    return [size if i < done else miss for size in nbytes for i in range(n)]


def _write_answers(result: kvcore.HostResult, nparts: int) -> list[int]:
    """``batch_set``'s answers in FastDeploy's key order: 0 for a block stored or refused by
    the store's admission (not a failure), :data:`FAILED` for an admitted block that was not
    stored."""
    row = [0 if ok else FAILED for ok in result.handled]
    return row * nparts
