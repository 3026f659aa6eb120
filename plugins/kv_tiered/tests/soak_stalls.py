"""Issue 62 #1 at length: soaks of file over Mooncake, each policy, the master stalled at
each writer kill (what ``test_tiered_soak.py``'s stall test runs once per policy, repeated).

    .venv/bin/python plugins/kv_tiered/tests/soak_stalls.py RUNS KILLS OUT.json

Each soak: a fresh cluster and store, KILLS writers, each kill inside a stall of the master
(``test_tiered_soak.stalling_master``). One line per soak; OUT.json has every soak's counts.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import test_tiered_soak as ts
from kv_mooncake.testing import MooncakeCluster


def main() -> None:
    runs, kills, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    out: dict[str, object] = {"runs": runs, "kills_per_run": kills, "stall_s": ts.STALL_S}
    soaks: list[dict[str, object]] = []
    for policy in ("write-through", "write-back-on-evict"):
        for seed in range(runs):
            with tempfile.TemporaryDirectory() as d, MooncakeCluster(storage_bytes=256 << 20) as cl:
                mooncake = {"backend": "mooncake", "config": cl.config(default_timeout_s=2.0)}
                config = {
                    "tiers": [ts.near_file(pathlib.Path(d)), mooncake],
                    "write_policy": policy,
                }

                t0 = time.monotonic()
                counts = ts.soak(config, kills, ts.stalling_master(cl), seed=seed)
                counts.update(policy=policy, seed=seed, seconds=round(time.monotonic() - t0, 1))
                soaks.append(counts)
                print(json.dumps(counts), flush=True)
    out["soaks"] = soaks
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
