"""The ``kvcore`` command: backends, demo, bench, check."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from typing import Any

from kvcore.schemas import parse_config_arg

__all__ = ["load_config_arg", "main"]


def load_config_arg(value: str | None) -> dict[str, Any]:
    """``--config`` takes inline JSON (``'{"root": "/data"}'``) or a path to a JSON file."""
    try:
        return parse_config_arg(value)
    except ValueError as exc:
        raise SystemExit(f"kvcore: --config: {exc}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcore", description="Third-tier KV-cache storage for LLM serving engines."
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("backends", help="list installed backends")
    b.add_argument("--json", action="store_true", help="machine-readable output")

    def backend_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--backend", default="file", help="backend name (default: file)")
        sp.add_argument("--config", default=None, help="backend config: JSON or a JSON file path")

    d = sub.add_parser("demo", help="replay a multi-turn chat workload through a backend")
    backend_args(d)
    d.add_argument("--conversations", type=int, default=8)
    d.add_argument("--turns", type=int, default=6)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print the summary as JSON")

    bench = sub.add_parser("bench", help="backend throughput through kvcore vs raw baselines")
    backend_args(bench)
    bench.add_argument("--blocks", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--json", action="store_true")

    c = sub.add_parser("check", help="run the conformance kit against an installed backend")
    c.add_argument("name")
    c.add_argument("--config", default=None, help="backend config: JSON or a JSON file path")
    c.add_argument("-k", dest="keyword", default=None, help="only tests matching this expression")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # Paddle's CPU wheel warns about a missing compiler cache on import: noise for users
    warnings.filterwarnings("ignore", message="No ccache found")
    if args.command == "backends":
        from kvcore.cli.backends import run
    elif args.command == "demo":
        from kvcore.cli.demo import run
    elif args.command == "bench":
        from kvcore.cli.bench import run
    else:
        from kvcore.cli.check import run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
