"""Standalone GPU check of kvcore's CUDA swap library (csrc/swap_ops_cuda.cu).

Needs only numpy, nvcc and a CUDA device: device and pinned memory come from the library's own
helpers (kvc_cuda_malloc / kvc_cuda_host_alloc), so neither Paddle, torch nor CuPy is required.
Builds the library (or takes --lib), checks byte-exact round trips of both ops in both modes, and
measures GB/s against one cudaMemcpy of the same bytes between pinned host and device memory.

    python tests/cuda/run_cuda_ops.py [--lib kvcore/_swap_cuda.so] [--json]

Exit status: 0 all checks passed, 1 a check failed, 2 no usable CUDA device.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "csrc"))
import cuda_build  # noqa: E402  (csrc/ is not a package: load it by path)

I32, I64, U64, P = ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
ERR = [ctypes.c_char_p, I32]


def find_nvcc() -> str | None:
    return cuda_build.find_nvcc()


def build(out_dir: str | Path, nvcc: str | None = None) -> Path:
    """Compile the library the way setup.py does; returns the .so path."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found")
    out = Path(out_dir) / "_swap_cuda.so"
    cmd = cuda_build.nvcc_command(nvcc, out)
    subprocess.run(cmd, cwd=cuda_build.CSRC, check=True, capture_output=True, text=True)
    return out


class Lib:
    def __init__(self, path: str | Path) -> None:
        self.lib = lib = ctypes.CDLL(str(path))
        sigs = {
            "kvc_cuda_device_count": [ctypes.POINTER(I32), *ERR],
            "kvc_cuda_host_alloc": [I64, ctypes.POINTER(U64), *ERR],
            "kvc_cuda_host_free": [U64, *ERR],
            "kvc_cuda_malloc": [I32, I64, ctypes.POINTER(U64), *ERR],
            "kvc_cuda_free": [U64, *ERR],
            "kvc_cuda_memcpy": [U64, U64, I64, *ERR],
            "kvc_cuda_synchronize": [I32, *ERR],
            "kvc_cuda_swap_all_layers": [
                I32,
                U64,
                P,
                P,
                P,
                I32,
                I64,
                I64,
                P,
                P,
                I64,
                I32,
                I32,
                *ERR,
            ],
            "kvc_cuda_swap_layout": [I32, U64, P, P, I32, I64, U64, I64, P, P, I64, I32, I32, *ERR],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, I32

    def call(self, name: str, *args: object) -> None:
        err = ctypes.create_string_buffer(512)
        rc = getattr(self.lib, name)(*args, err, len(err))
        if rc != 0:
            raise (ValueError if rc == 1 else RuntimeError)(err.value.decode())

    def device_count(self) -> int:
        n = I32(0)
        self.call("kvc_cuda_device_count", ctypes.byref(n))
        return n.value

    def malloc(self, nbytes: int) -> int:
        p = U64(0)
        self.call("kvc_cuda_malloc", 0, nbytes, ctypes.byref(p))
        return p.value

    def pinned(self, nbytes: int) -> np.ndarray:
        """Pinned host memory as a uint8 array (freed by the caller via free_pinned)."""
        p = U64(0)
        self.call("kvc_cuda_host_alloc", nbytes, ctypes.byref(p))
        return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(p.value), dtype=np.uint8)

    def h2d(self, dev: int, host: np.ndarray) -> None:
        self.call("kvc_cuda_memcpy", dev, host.ctypes.data, host.nbytes)

    def d2h(self, host: np.ndarray, dev: int) -> None:
        self.call("kvc_cuda_memcpy", host.ctypes.data, dev, host.nbytes)

    def all_layers(self, dev, host, nblk, bb, max_host, dids, hids, mode) -> None:
        a = [
            np.asarray(x, dtype=t)
            for x, t in (
                (dev, np.uint64),
                (host, np.uint64),
                (nblk, np.int64),
                (dids, np.int64),
                (hids, np.int64),
            )
        ]
        self.call(
            "kvc_cuda_swap_all_layers",
            0,
            0,
            *(x.ctypes.data for x in a[:3]),
            len(dev),
            bb,
            max_host,
            a[3].ctypes.data,
            a[4].ctypes.data,
            len(dids),
            mode,
            1,
        )

    def layout(self, dev, nblk, bb, staging, nslots, dids, sids, mode) -> None:
        a = [
            np.asarray(x, dtype=t)
            for x, t in ((dev, np.uint64), (nblk, np.int64), (dids, np.int64), (sids, np.int64))
        ]
        self.call(
            "kvc_cuda_swap_layout",
            0,
            0,
            a[0].ctypes.data,
            a[1].ctypes.data,
            len(dev),
            bb,
            staging,
            nslots,
            a[2].ctypes.data,
            a[3].ctypes.data,
            len(dids),
            mode,
            1,
        )


def check_round_trips(
    lib: Lib, block_bytes: int, nlayers: int = 4, nblocks: int = 24, extra_blocks: int = 6
) -> None:
    """Both ops, both modes, byte-exact; the last layer has fewer blocks (an extra layer)."""
    rng = np.random.default_rng(7)
    counts = [nblocks] * (nlayers - 1) + [extra_blocks]
    ref = [rng.integers(0, 256, (c, block_bytes), dtype=np.uint8) for c in counts]
    dev = [lib.malloc(r.nbytes) for r in ref]
    for d, r in zip(dev, ref, strict=True):
        lib.h2d(d, r)
    dids = [0, 1, 2, 5, 3, 4]  # runs and breaks; all < extra_blocks
    hids = [7, 8, 9, 1, 2, 3]
    max_host = 10
    hosts = [lib.pinned(max_host * block_bytes) for _ in ref]
    lib.all_layers(
        dev, [h.ctypes.data for h in hosts], counts, block_bytes, max_host, dids, hids, 0
    )
    for h, r in zip(hosts, ref, strict=True):
        assert np.array_equal(h.reshape(max_host, -1)[hids], r[dids]), "all_layers mode 0"
    zeros = [np.zeros_like(r) for r in ref]
    for d, z in zip(dev, zeros, strict=True):
        lib.h2d(d, z)
    lib.all_layers(
        dev, [h.ctypes.data for h in hosts], counts, block_bytes, max_host, dids, hids, 1
    )
    for d, r, z in zip(dev, ref, zeros, strict=True):
        out = np.empty_like(r)
        lib.d2h(out, d)
        want = z.copy()
        want[dids] = r[dids]
        assert np.array_equal(out, want), "all_layers mode 1"
        lib.h2d(d, r)

    sids = [4, 0, 2, 1, 5, 3]
    nslots = 6
    pinned_stage = lib.pinned(nslots * nlayers * block_bytes)
    pageable_stage = np.zeros(nslots * nlayers * block_bytes, dtype=np.uint8)
    for stage in (pinned_stage, pageable_stage):  # kernel path and cudaMemcpy fallback
        lib.layout(dev, counts, block_bytes, stage.ctypes.data, nslots, dids, sids, 0)
        view = stage.reshape(nslots, nlayers, block_bytes)
        for li, r in enumerate(ref):
            assert np.array_equal(view[sids, li], r[dids]), "layout gather"
        for d, z in zip(dev, zeros, strict=True):
            lib.h2d(d, z)
        lib.layout(dev, counts, block_bytes, stage.ctypes.data, nslots, dids, sids, 1)
        for d, r in zip(dev, ref, strict=True):
            out = np.empty_like(r)
            lib.d2h(out, d)
            want = np.zeros_like(r)
            want[dids] = r[dids]
            assert np.array_equal(out, want), "layout scatter"
            lib.h2d(d, r)
    try:
        lib.layout(
            dev, counts, block_bytes, pinned_stage.ctypes.data, nslots, [extra_blocks], [0], 0
        )
        raise AssertionError("out-of-range id of the extra layer was accepted")
    except ValueError as exc:
        assert f"of layer {nlayers - 1}" in str(exc), exc
    for d in dev:
        lib.call("kvc_cuda_free", d)


def _random_case(rng: np.random.Generator) -> tuple[int, list[int], int]:
    """(block bytes, blocks per layer, pairs): a random layout in one of kvcore's dtypes."""
    heads, block = int(rng.integers(1, 9)), int(rng.choice([1, 3, 16, 64]))
    dim = int(rng.choice([8, 64, 128]))
    block_bytes = int(
        rng.choice(
            [
                heads * block * dim * 2,  # bfloat16 / float16 K or V
                heads * block * dim,  # fp8 / uint8 K or V
                heads * block * 4,  # float32 scales
                heads * block * 2,  # bfloat16 scales
                int(rng.integers(1, 5000)),  # any size: the unaligned byte path
            ]
        )
    )
    nlayers = int(rng.integers(1, 7))
    main = int(rng.integers(4, 40))
    extra = int(rng.integers(0, 3))  # extra layers (an MTP draft's) with fewer blocks
    counts = [main] * (nlayers - extra) + [int(rng.integers(2, main + 1))] * extra
    pairs = int(rng.integers(1, min(counts) + 1))
    return block_bytes, counts, pairs


def check_random(lib: Lib, trials: int, seed: int = 11) -> int:
    """Random layouts, ids and host memory kinds: both ops, both directions, byte-exact.

    Ids mix merged runs (consecutive on both sides) and scattered blocks; host memory is pinned
    and mapped (the kernel path) or pageable (the copy-engine path).
    """
    rng = np.random.default_rng(seed)
    for trial in range(trials):
        block_bytes, counts, n = _random_case(rng)
        nlayers = len(counts)
        ref = [rng.integers(0, 256, (c, block_bytes), dtype=np.uint8) for c in counts]
        dev = [lib.malloc(r.nbytes) for r in ref]
        for d, r in zip(dev, ref, strict=True):
            lib.h2d(d, r)
        limit = min(counts)
        if rng.random() < 0.5:  # one merged run on both sides
            start = int(rng.integers(0, limit - n + 1))
            dids = list(range(start, start + n))
        else:
            dids = rng.permutation(limit)[:n].tolist()
        nhost = n + int(rng.integers(0, 4))
        hids = rng.permutation(nhost)[:n].tolist()
        if rng.random() < 0.5:
            hids = sorted(hids)
        pinned = rng.random() < 0.5
        label = f"trial {trial}: {block_bytes} B x {counts}, {n} pairs, pinned={pinned}"

        def host_buffer(nbytes: int, pinned: bool = pinned) -> np.ndarray:
            return lib.pinned(nbytes) if pinned else np.zeros(nbytes, dtype=np.uint8)

        hosts = [host_buffer(nhost * block_bytes) for _ in ref]
        lib.all_layers(dev, [h.ctypes.data for h in hosts], counts, block_bytes, nhost,
                       dids, hids, 0)  # fmt: skip
        for h, r in zip(hosts, ref, strict=True):
            assert np.array_equal(h.reshape(nhost, -1)[hids], r[dids]), f"all_layers out, {label}"
        stage = host_buffer(nhost * nlayers * block_bytes)
        lib.layout(dev, counts, block_bytes, stage.ctypes.data, nhost, dids, hids, 0)
        view = stage.reshape(nhost, nlayers, block_bytes)
        for li, r in enumerate(ref):
            assert np.array_equal(view[hids, li], r[dids]), f"layout gather, {label}"
        for op in ("all_layers", "layout"):
            for d, r in zip(dev, ref, strict=True):
                lib.h2d(d, np.zeros_like(r))
            if op == "all_layers":
                lib.all_layers(dev, [h.ctypes.data for h in hosts], counts, block_bytes, nhost,
                               dids, hids, 1)  # fmt: skip
            else:
                lib.layout(dev, counts, block_bytes, stage.ctypes.data, nhost, dids, hids, 1)
            for d, r in zip(dev, ref, strict=True):
                out = np.empty_like(r)
                lib.d2h(out, d)
                want = np.zeros_like(r)
                want[dids] = r[dids]
                assert np.array_equal(out, want), f"{op} in, {label}"
        for d in dev:
            lib.call("kvc_cuda_free", d)
        if pinned:
            for h in (*hosts, stage):
                lib.call("kvc_cuda_host_free", h.ctypes.data)
    return trials


def bench(
    lib: Lib, layers: int = 28, blocks: int = 64, block_bytes: int = 128 << 10, reps: int = 15
) -> dict[str, float]:
    rng = np.random.default_rng(0)
    cache_blocks = 2 * blocks
    dev = [lib.malloc(cache_blocks * block_bytes) for _ in range(layers)]
    total = layers * blocks * block_bytes
    hosts = [lib.pinned(blocks * block_bytes) for _ in range(layers)]
    stage = lib.pinned(total)
    big = lib.malloc(total)
    dids = rng.permutation(cache_blocks)[:blocks].tolist()
    hids = rng.permutation(blocks).tolist()
    sids = list(range(blocks))
    hp = [h.ctypes.data for h in hosts]
    counts = [cache_blocks] * layers

    pageable = [np.zeros(blocks * block_bytes, dtype=np.uint8) for _ in range(layers)]
    pp = [h.ctypes.data for h in pageable]
    contenders = {
        "cuda_memcpy_d2h_pinned_gbps": lambda: lib.d2h(stage, big),
        "cuda_memcpy_h2d_pinned_gbps": lambda: lib.h2d(big, stage),
        "swap_all_layers_to_host_gbps": lambda: lib.all_layers(
            dev, hp, counts, block_bytes, blocks, dids, hids, 0
        ),
        "swap_all_layers_to_device_gbps": lambda: lib.all_layers(
            dev, hp, counts, block_bytes, blocks, dids, hids, 1
        ),
        "swap_all_layers_to_host_pageable_gbps": lambda: lib.all_layers(
            dev, pp, counts, block_bytes, blocks, dids, hids, 0
        ),
        "swap_layout_gather_gbps": lambda: lib.layout(
            dev, counts, block_bytes, stage.ctypes.data, blocks, dids, sids, 0
        ),
        "swap_layout_scatter_gbps": lambda: lib.layout(
            dev, counts, block_bytes, stage.ctypes.data, blocks, dids, sids, 1
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for rep in range(reps + 1):  # contenders alternate within a repetition; the first warms up
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            lib.call("kvc_cuda_synchronize", 0)
            if rep:
                times[name].append(time.perf_counter() - t0)
    figures = {k: round(total / statistics.median(v) / 1e9, 3) for k, v in times.items()}
    for d in [*dev, big]:
        lib.call("kvc_cuda_free", d)
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lib", help="prebuilt _swap_cuda.so (default: build into a temp dir)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trials", type=int, default=200, help="random layouts checked")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lib = Lib(args.lib or build(tmp))
        try:
            ndev = lib.device_count()
        except RuntimeError as exc:
            print(f"no usable CUDA device: {exc}", file=sys.stderr)
            return 2
        if ndev == 0:
            print("no CUDA device", file=sys.stderr)
            return 2
        for bb in (128 << 10, 2048, 1000):  # bf16 KV block, fp32 scales, unaligned bytes path
            check_round_trips(lib, bb)
        trials = check_random(lib, args.trials)
        figures = bench(lib)
        d2h, h2d = figures["cuda_memcpy_d2h_pinned_gbps"], figures["cuda_memcpy_h2d_pinned_gbps"]
        ratios = {
            k.removesuffix("_gbps") + "_vs_memcpy": round(
                v / (d2h if "host" in k or "gather" in k else h2d), 3
            )
            for k, v in figures.items()
            if k.startswith("swap_")
        }
        report = {
            "checks": "passed",
            "random_trials": trials,
            "figures": figures,
            "ratios": ratios,
            "goals": {k: ">= 0.85" for k in ratios if "pageable" not in k},
        }
        print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
