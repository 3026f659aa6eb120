"""``kvcore events BACKEND``: tail a store's events as JSON lines (see :mod:`kvcore.events`).

Opens the backend for the namespace given (no layout: this process moves no data), subscribes
to its event stream and prints one JSON object per event on stdout, flushed at once, until
interrupted, ``--count`` events or ``--duration`` seconds. What the stream holds depends on
the backend: kv_file reports every change in its directory, whoever makes it; a backend that
reports only what passes through this process (the in-process ``memory``) prints nothing here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvcore.cli.common import open_for_cli
from kvcore.cli.console import CommandConsole
from kvcore.cli.errors import ExitCode
from kvcore.schemas import BackendContext


def run(args: argparse.Namespace, console: CommandConsole) -> int:
    from kvcore.cli.options import load_config_arg

    config = load_config_arg(args.config)
    backend = open_for_cli(args.name, config, BackendContext(namespace=args.namespace))
    printed = 0
    deadline = None if args.duration is None else time.monotonic() + args.duration
    out = sys.stdout
    try:
        with backend.events.subscribe(max_objects=args.max_queue) as sub:
            # a line on stderr, not stdout: stdout holds events only, for a pipe to read
            console.err.print(
                f"kvcore events: following backend {args.name!r}, namespace "
                f"{args.namespace!r} (Ctrl-C to stop)"
            )
            while args.count is None or printed < args.count:
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    break
                event = sub.get(timeout=0.5 if wait is None else min(wait, 0.5))
                if event is None:
                    continue
                out.write(json.dumps(event.to_dict(), separators=(",", ":")) + "\n")
                out.flush()
                printed += 1
    except KeyboardInterrupt:
        pass
    finally:
        backend.close()
    return int(ExitCode.OK)
