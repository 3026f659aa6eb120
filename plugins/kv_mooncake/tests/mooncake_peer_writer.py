"""Helper process for test_mooncake_sharing: write N blocks, report them, wait for 'exit'.

Usage: python mooncake_peer_writer.py CONFIG_JSON NUM_BLOCKS
"""

from __future__ import annotations

import json
import sys

import kvcore
from kvcore.testing import Harness, small_layout


def main() -> int:
    config = json.loads(sys.argv[1])
    n = int(sys.argv[2])
    layout = small_layout()
    backend = kvcore.open_backend("mooncake", config, context={"layout": layout})
    try:
        h = Harness(backend, layout)
        seq = h.new_sequence(n)
        written = h.write(seq)
        print(json.dumps({"written": written, "keys": seq.keys, "token_ids": seq.token_ids}))
        sys.stdout.flush()
        sys.stdin.readline()  # the data lives in this process's segment until we close
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
