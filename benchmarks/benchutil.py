"""What every benchmark here shares: the layout arguments and the report format."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_layout_args(ap: argparse.ArgumentParser, blocks: int, blocks_help: str = "") -> None:
    """The typical layout (28 layers x 8 heads x 64 tokens x 128 dim) and a block count."""
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=blocks, help=blocks_help or "blocks per call")


def emit(report: dict[str, Any], as_json: bool) -> None:
    """One JSON object on stdout, or the same figures as aligned text for a person."""
    if as_json:
        print(json.dumps(report))
        return
    goals = report.get("goals", {})
    for name, value in report["figures"].items():
        print(f"{name:40s} {value}")
    for name, value in report["ratios"].items():
        print(f"{name:40s} {value}  (goal {goals.get(name, '-')})")
