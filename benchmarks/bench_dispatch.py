"""Per-call overhead of going through an opened backend instead of calling the plugin directly.

The opened backend adds a pluggy hook call, exception isolation, result validation, deadline
accounting and metrics. Measured on a backend whose hooks return at once, for a 64-block batch
(typical request) and for an empty one, against the plugin's bound method on the same request.
Goal: <= 20 us of overhead per batch op. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import kvcore
from kvcore import BlockRequest, hookimpl


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


def _per_call_us(fn, request, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(request)
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true", help="(the output is always JSON)")
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    layout = kvcore.CacheLayout(num_layers=28, num_heads=8, block_size=64, head_dim=128)
    backend = kvcore.open_backend(NullBackend, context={"layout": layout})
    plugin = backend.plugin
    keys = kvcore.block_hashes(list(range(64 * 64)), 64)
    sizes = tuple(layout.part_bytes(p) for p in layout.parts)  # the door checks them
    host = kvcore.HostBuffers(ptrs=tuple((0, 0) for _ in keys), nbytes=sizes)
    figures: dict[str, float] = {}
    ratios: dict[str, float] = {}
    goals: dict[str, str] = {}
    for label, n in (("64_blocks", 64), ("empty", 0)):
        req = backend.request("bench", keys[:n], timeout_s=3600, host=host if n else None)
        for op, direct, facade in (
            ("query", plugin.kvcore_query, backend.query),
            ("write", plugin.kvcore_write, backend.write if n else None),
        ):
            if facade is None:
                continue
            d = statistics.median(
                _per_call_us(direct, req, args.calls) for _ in range(args.repeats)
            )
            f = statistics.median(
                _per_call_us(facade, req, args.calls) for _ in range(args.repeats)
            )
            figures[f"{op}_{label}_direct_us"] = round(d, 3)
            figures[f"{op}_{label}_through_kvcore_us"] = round(f, 3)
            figures[f"{op}_{label}_overhead_us"] = round(f - d, 3)
            ratios[f"{op}_{label}_overhead_us_vs_goal"] = round((f - d) / 20.0, 3)
            goals[f"{op}_{label}_overhead_us_vs_goal"] = "<= 1.0 (overhead <= 20 us)"
    # building the request (object names for every block and part) is part of a real call
    t0 = time.perf_counter()
    for _ in range(2000):
        backend.request("bench", keys, timeout_s=1)
    figures["build_request_64_blocks_us"] = round((time.perf_counter() - t0) / 2000 * 1e6, 3)
    backend.close()
    print(
        json.dumps(
            {
                "figures": figures,
                "ratios": ratios,
                "goals": goals,
                "machine": f"{platform.machine()} {platform.python_version()}",
            }
        )
    )


if __name__ == "__main__":
    main()
