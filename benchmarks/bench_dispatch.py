"""Per-call overhead of going through an opened backend instead of calling the plugin directly.

The opened backend adds a pluggy hook call, exception isolation, result validation, deadline
accounting and metrics. Measured on a backend whose hooks return at once, for a 64-block batch
(typical request) and for an empty one, against the plugin's bound method on the same request.
Each repetition times both sides (``--calls`` calls each), the direct call first in even
repetitions and second in odd ones; the overhead is through kvcore minus direct within the same
repetition (paired). Figures and ratios are the median and range (min, max) over ``--reps``.
Goal: <= 20 us of overhead per batch op. ``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from benchutil import Report, emit

import kvcore
from kvcore import BlockRequest, hookimpl

GOAL_US = 20.0


class NullConfig(kvcore.BackendConfig):
    pass


class NullBackend:
    """Answers every hook immediately: what is left to time is kvcore's dispatch."""

    config_model = NullConfig
    capabilities = kvcore.Capabilities()

    def __init__(self, config: NullConfig, context: kvcore.BackendContext) -> None:
        pass

    @hookimpl
    def kvcore_query(self, request: BlockRequest) -> int:
        return request.num_blocks

    @hookimpl
    def kvcore_read(self, request: BlockRequest) -> int:
        return request.num_blocks

    @hookimpl
    def kvcore_write(self, request: BlockRequest) -> int:
        return request.num_blocks


def _per_call_us(fn: Callable[[BlockRequest], object], request: BlockRequest, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(request)
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--calls", type=int, default=20_000, help="calls timed per side and repetition")
    # --repeats: the flag's former name, still taken
    ap.add_argument("--reps", "--repeats", dest="reps", type=int, default=7)
    args = ap.parse_args()

    layout = kvcore.CacheLayout(num_layers=28, num_heads=8, block_size=64, head_dim=128)
    # the facade's dispatch alone: no block digests (they hash the buffers)
    backend = kvcore.open_backend(NullBackend, context={"layout": layout}, verify_blocks="never")
    plugin = backend.plugin
    keys = kvcore.block_hashes(list(range(64 * 64)), 64)
    sizes = tuple(layout.part_bytes(p) for p in layout.parts)  # the door checks them
    host = kvcore.HostBuffers(ptrs=tuple((0, 0) for _ in keys), nbytes=sizes)
    report = Report()
    for label, n in (("64_blocks", 64), ("empty", 0)):
        req = backend.request("bench", keys[:n], timeout_s=3600, host=host if n else None)
        for op, direct, facade in (
            ("query", plugin.kvcore_query, backend.query),
            ("write", plugin.kvcore_write, backend.write if n else None),
        ):
            if facade is None:
                continue
            sides = {"direct": direct, "through_kvcore": facade}
            us: dict[str, list[float]] = {side: [] for side in sides}
            for rep in range(args.reps):
                order = list(sides) if rep % 2 == 0 else list(reversed(sides))
                for side in order:
                    us[side].append(_per_call_us(sides[side], req, args.calls))
            # paired: the two sides of one repetition ran back to back on the same machine state
            overhead = [f - d for f, d in zip(us["through_kvcore"], us["direct"], strict=True)]
            report.figure(f"{op}_{label}_direct_us", us["direct"], "us")
            report.figure(f"{op}_{label}_through_kvcore_us", us["through_kvcore"], "us")
            report.figure(f"{op}_{label}_overhead_us", overhead, "us")
            report.ratio(
                f"{op}_{label}_overhead_us_vs_goal",
                overhead,
                [GOAL_US] * len(overhead),
                goal=f"<= 1.0 (overhead <= {GOAL_US:g} us)",
            )
    # building the request (object names for every block and part) is part of a real call
    build_us = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        for _ in range(2000):
            backend.request("bench", keys, timeout_s=1)
        build_us.append((time.perf_counter() - t0) / 2000 * 1e6)
    report.figure("build_request_64_blocks_us", build_us, "us")
    backend.close()
    report.notes["setup"] = {"calls": args.calls, "reps": args.reps}
    emit(report.as_dict(), args.json)


if __name__ == "__main__":
    main()
