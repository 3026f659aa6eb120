"""kv_mooncake through kvcore against raw MooncakeDistributedStore calls, in one run.

Starts a mooncake_master on 127.0.0.1 (inside a loopback-only network namespace when run as
root), opens the ``mooncake`` backend through ``kvcore.open_backend`` (``verify_blocks=
"never"``: the backend's own overhead, without kvcore's block digests) and registers its host
staging buffers as an engine would. Each repetition writes and reads the same bytes twice
with the same client: once through the backend (``Backend.request`` + ``write``/``read``,
which adds the existence check, key mapping and leading-run accounting) and once with raw
``batch_put_from`` / ``batch_get_into`` on fresh keys, then times ``--query-iters`` existence
queries of those keys each way (``Backend.query`` against raw ``batch_is_exist``, interleaved).
Which side goes first flips each repetition. A third contender writes through the backend
with block metadata (``--meta-bytes`` per block, the size of a vLLM block descriptor): what
the metadata companions cost a write (``write_with_meta_vs_write``). Figures are the median and range (min, max) over
``--reps``; each ratio is computed per repetition from the two sides measured in it (paired),
then summarised the same way. The raw client doing the same I/O is named as the limit: kvcore
beating it by more than 5 % is flagged. ``--json`` prints one JSON object
``{"figures", "ratios", "goals", "flags", ..., "machine"}``.

Typical shape: 28 layers x 8 heads x 64 tokens x 128 dims bfloat16, so 3.5 MiB per K or V
object and 16 blocks (112 MiB) per call. The data lands in the client's own segment, so this
measures Mooncake's local path plus kvcore's overhead, not a network.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable
from functools import partial

from kv_mooncake.testing import MooncakeCluster, isolate_loopback

NETNS = isolate_loopback()  # before any Python thread exists

import numpy as np  # noqa: E402
from benchutil import Report, add_layout_args, emit  # noqa: E402
from kv_mooncake.store_keys import store_key  # noqa: E402

import kvcore  # noqa: E402
from kvcore.keys import KeyScope, block_hashes  # noqa: E402


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def staging(n: int, sizes: tuple[int, ...], fill: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    arrays = [np.empty((n, s), dtype=np.uint8) for s in sizes]
    for a in arrays:
        a[...] = rng.integers(0, 256, a.shape, dtype=np.uint8) if fill else 0
    return arrays


def host_buffers(arrays: list[np.ndarray]) -> kvcore.HostBuffers:
    sizes = tuple(a.shape[1] for a in arrays)
    n = arrays[0].shape[0]
    ptrs = tuple(tuple(a.ctypes.data + i * a.shape[1] for a in arrays) for i in range(n))
    return kvcore.HostBuffers(ptrs=ptrs, nbytes=sizes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_layout_args(ap, blocks=16)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--query-iters", type=int, default=200, help="queries per repetition")
    ap.add_argument("--segment-mib", type=int, default=1024)
    ap.add_argument("--meta-bytes", type=int, default=138, help="block metadata per block")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    layout = kvcore.CacheLayout(
        num_layers=args.layers,
        num_heads=args.heads,
        block_size=args.block_size,
        head_dim=args.head_dim,
    )
    n = args.blocks
    sizes = tuple(layout.part_bytes(p) for p in layout.parts)
    total = n * sum(sizes)
    if 4 * total > args.segment_mib << 20:
        ap.error(f"--segment-mib must hold 4 calls' worth ({4 * total >> 20} MiB)")

    with MooncakeCluster(storage_bytes=0) as cluster:
        config = cluster.config(global_segment_size=args.segment_mib << 20)
        # the backend's own path against the raw client's: without kvcore's block digests,
        # which every caller gets by default (their cost is measured where callers are:
        # bench_vllm's verify_blocks="never" run against the default one)
        backend = kvcore.open_backend(
            "mooncake", config, context={"layout": layout}, verify_blocks="never"
        )
        try:
            report = run(backend, layout, n, sizes, total, args)
        finally:
            backend.close()

    report.notes["setup"] = {
        "network_namespace": "private loopback" if NETNS is None else f"shared: {NETNS}",
        "object_mib": sizes[0] / (1 << 20),
        "call_mib": total / (1 << 20),
        "reps": args.reps,
        "query_iters": args.query_iters,
    }
    emit(report.as_dict(), args.json)


def run(
    backend: kvcore.Backend,
    layout: kvcore.CacheLayout,
    n: int,
    sizes: tuple[int, ...],
    total: int,
    args: argparse.Namespace,
) -> Report:
    store = backend.plugin.store
    src, dst = staging(n, sizes, fill=True), staging(n, sizes, fill=False)
    for a in (*src, *dst):
        backend.register_buffer(a.ctypes.data, a.nbytes)
    src_host, dst_host = host_buffers(src), host_buffers(dst)
    src_ptrs, flat_sizes = src_host.flat()
    dst_ptrs, _ = dst_host.flat()

    times: dict[str, list[float]] = {
        k: [] for k in ("kv_w", "raw_w", "kv_r", "raw_r", "kv_q", "raw_q", "meta_w", "meta_r")
    }
    metas = [bytes([i % 251]) * args.meta_bytes for i in range(n)]
    warmup = 2
    for rep in range(warmup + args.reps):
        tokens = np.random.default_rng().integers(0, 150_000, n * layout.block_size).tolist()
        scope = KeyScope(namespace=f"bench-{uuid.uuid4().hex}")
        keys = block_hashes(tokens, layout.block_size, scope)
        raw_keys = [f"bench-raw/{uuid.uuid4().hex}/{i}" for i in range(n * len(sizes))]
        meta_keys = block_hashes(
            tokens, layout.block_size, KeyScope(namespace=scope.namespace + "m")
        )

        kv_w = partial(kv_write, backend, keys, src_host)
        kv_r = partial(kv_read, backend, keys, dst_host)
        raw_write = partial(store.batch_put_from, raw_keys, src_ptrs, flat_sizes)
        raw_read = partial(store.batch_get_into, raw_keys, dst_ptrs, flat_sizes)
        meta_w = partial(kv_write, backend, meta_keys, src_host, metas)
        meta_r = partial(kv_read, backend, meta_keys, dst_host)

        order = [("kv", kv_w, kv_r), ("raw", raw_write, raw_read), ("meta", meta_w, meta_r)]
        if rep % 2:
            order.reverse()
        for name, write, read in order:
            done, t_write = timed(write)
            check(name, "write", done, n, flat_sizes)
            done, t_read = timed(read)
            check(name, "read", done, n, flat_sizes)
            for a, b in zip(src, dst, strict=True):
                if not np.array_equal(a, b):
                    raise SystemExit(f"{name} read returned different bytes")
                b[...] = 0
            if rep >= warmup:
                times[f"{name}_w"].append(t_write)
                times[f"{name}_r"].append(t_read)
        if rep >= warmup:
            kv_q, raw_q = time_queries(
                backend, store, keys, args.query_iters, kv_first=rep % 2 == 0
            )
            times["kv_q"].append(kv_q)
            times["raw_q"].append(raw_q)
        names = [
            store_key(m)
            for ks in (keys, meta_keys)
            for names in backend.request("x", ks).object_names
            for m in names
        ]
        store.batch_remove(names + raw_keys + [f"{m}#meta" for m in names], True)

    report = Report()
    gbps = {k: [total / t / 1e9 for t in times[k]] for k in ("kv_w", "raw_w", "kv_r", "raw_r")}
    report.figure("kvcore_write_gbps", gbps["kv_w"], "GB/s")
    report.figure("raw_write_gbps", gbps["raw_w"], "GB/s")
    report.figure("kvcore_read_gbps", gbps["kv_r"], "GB/s")
    report.figure("raw_read_gbps", gbps["raw_r"], "GB/s")
    report.figure("kvcore_query_us", [t * 1e6 for t in times["kv_q"]], "us")
    report.figure("raw_query_us", [t * 1e6 for t in times["raw_q"]], "us")
    # Paired: each repetition runs both sides back to back, so per-repetition ratios cancel the
    # slow drift of a shared machine better than a ratio of medians. Raw time / kvcore time:
    # > 1 would be kvcore faster than the same client doing the same I/O (the limit).
    report.ratio("write_vs_raw", times["raw_w"], times["kv_w"], goal=">= 0.9", limit=True)
    report.ratio("read_vs_raw", times["raw_r"], times["kv_r"], goal=">= 0.9", limit=True)
    report.ratio("query_vs_raw", times["raw_q"], times["kv_q"], limit=True)
    report.ratio("write_with_meta_vs_write", times["kv_w"], times["meta_w"])
    return report


def kv_write(
    backend: kvcore.Backend,
    keys: list[str],
    host: kvcore.HostBuffers,
    block_meta: list[bytes] | None = None,
) -> int:
    """One engine-side call: build the request (names, deadline), then write."""
    return backend.write(backend.request("bench-w", keys, host=host, block_meta=block_meta))


def kv_read(backend: kvcore.Backend, keys: list[str], host: kvcore.HostBuffers) -> int:
    return backend.read(backend.request("bench-r", keys, host=host))


def check(name: str, op: str, done: object, n: int, sizes: list[int]) -> None:
    if name in ("kv", "meta"):
        ok = done == n
    elif op == "write":
        ok = all(r == 0 for r in done)  # type: ignore[union-attr]
    else:
        ok = list(done) == sizes  # type: ignore[call-overload]
    if not ok:
        raise SystemExit(f"{name} {op} failed: {done!r}")


def time_queries(
    backend: kvcore.Backend, store: object, keys: list[str], iters: int, kv_first: bool
) -> tuple[float, float]:
    """Median seconds of one query through kvcore and of one raw ``batch_is_exist`` of the same
    objects, over ``iters`` interleaved pairs; ``kv_first``: which side leads each pair."""
    names = [store_key(m) for names in backend.request("q", keys).object_names for m in names]
    sides: dict[str, Callable[[], object]] = {
        "kv": lambda: backend.query(backend.request("bench-q", keys)),
        "raw": lambda: store.batch_is_exist(names),  # type: ignore[attr-defined]
    }
    order = ("kv", "raw") if kv_first else ("raw", "kv")
    seconds: dict[str, list[float]] = {"kv": [], "raw": []}
    for _ in range(iters):
        for side in order:
            _, t = timed(sides[side])
            seconds[side].append(t)
    return statistics.median(seconds["kv"]), statistics.median(seconds["raw"])


if __name__ == "__main__":
    main()
