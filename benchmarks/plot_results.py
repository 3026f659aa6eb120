"""Draw one chart per benchmark report: ``python benchmarks/plot_results.py out/*.json``.

Each file holds what a benchmark printed with ``--json`` (one JSON object with ``figures``,
``ratios`` and ``goals``; lines before it, such as log output, are skipped). The chart is
written beside the others as ``<out-dir>/<file stem>.png``: the figures of the report's main
unit (GB/s when it has any) with the baselines in grey, and the ratios against their same-run
baselines with each goal marked. ``--markdown`` prints the image links for RESULTS.md.

Needs matplotlib: ``pip install -e ".[plot]"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvcore.cli.errors import CliError
from kvcore.cli.plot import plot_report

HERE = Path(__file__).resolve().parent


def read_report(path: Path) -> dict[str, Any]:
    """The last line of ``path`` that is a JSON object with ``figures`` (or the whole file)."""
    text = path.read_text()
    candidates = [text, *reversed(text.splitlines())]
    for chunk in candidates:
        chunk = chunk.strip()
        if not chunk.startswith("{"):
            continue
        try:
            data = json.loads(chunk)
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "figures" in data:
            return data
    raise ValueError(f"{path}: no JSON object with 'figures' (the output of a benchmark's --json)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("reports", nargs="+", type=Path, help="JSON files, one benchmark report each")
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=HERE / "charts",
        help="where the PNG files go (default: benchmarks/charts)",
    )
    ap.add_argument("--markdown", action="store_true", help="print a Markdown image link per chart")
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for path in args.reports:
        try:
            report = read_report(path)
            chart = plot_report(report, args.out_dir / f"{path.stem}.png", title=path.stem)
        except (OSError, ValueError, CliError) as exc:
            print(f"plot_results: {exc}", file=sys.stderr)
            return 1
        if args.markdown:
            try:
                link = chart.resolve().relative_to(HERE)
            except ValueError:
                link = chart
            print(f"![{path.stem}]({link.as_posix()})")
        else:
            print(chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
