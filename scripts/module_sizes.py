#!/usr/bin/env python3
"""The "Module sizes" table of docs/architecture.md: every module over the limit, and why.

A module over LIMIT lines must say why it stays one module. This script finds them (kvcore/,
each backend plugin's package, each engine adapter's package, benchmarks/; never tests) and
prints the table's rows, keeping the reason of every row the document already has, so an
author regenerates the table and writes reasons only for the new rows:

    python scripts/module_sizes.py            # print the table (header and rows)
    python scripts/module_sizes.py --write    # put it into docs/architecture.md
    python scripts/module_sizes.py --check    # exit 1 naming every row that is wrong

A row is wrong when a module over the limit has none or an empty reason, when a listed module
is no longer over the limit (or gone), or when its listed count is off from the real one by more
than TOLERANCE (so the table need not be regenerated at every edit). tests/test_module_sizes.py
runs the same check.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Module sizes"
#: a module with more lines than this needs a row
LIMIT = 500
#: how far (a fraction of the real count) a listed count may drift before the row is stale
TOLERANCE = 0.10
#: where the modules are: the core, each plugin's and each adapter's package, the benchmarks
PACKAGE_GLOBS = ("kvcore", "plugins/*/kv_*", "integrations/*/kvcore_*", "benchmarks")
HEADER = "| module | lines | why it stays one module |\n| --- | --- | --- |"

_CELL_SPLIT = re.compile(r"(?<!\\)\|")


@dataclass(frozen=True)
class Row:
    """One row of the table: a module's path (from the repository root), lines, reason."""

    path: str
    lines: int
    reason: str

    def markdown(self) -> str:
        return f"| `{self.path}` | {self.lines} | {self.reason} |"


def is_test(path: Path) -> bool:
    """Test code is never counted: files under a ``tests`` folder, ``test_*.py``, conftest."""
    return "tests" in path.parts or path.name.startswith("test_") or path.name == "conftest.py"


def count_lines(path: Path) -> int:
    """Lines as an editor numbers them (``wc -l`` for a file that ends with a newline)."""
    return len(path.read_text(encoding="utf-8").splitlines())


def module_lines(root: Path = ROOT) -> dict[str, int]:
    """Every package module's line count, by path from ``root``."""
    found: dict[str, int] = {}
    for pattern in PACKAGE_GLOBS:
        for package in sorted(root.glob(pattern)):
            if not package.is_dir():
                continue
            for path in sorted(package.rglob("*.py")):
                relative = path.relative_to(root)
                if is_test(relative) or "__pycache__" in relative.parts:
                    continue
                found[relative.as_posix()] = count_lines(path)
    return found


def section_bounds(doc: str) -> tuple[int, int]:
    """Where the table of the section starts and ends in ``doc`` (character offsets)."""
    start = doc.find(SECTION)
    if start < 0:
        raise SystemExit(f"{DOC.name} has no {SECTION!r} section")
    following = doc.find("\n## ", start + len(SECTION))
    end = len(doc) if following < 0 else following + 1
    lines = doc[start:end].splitlines(keepends=True)
    offset = start
    table_start = table_end = None
    for line in lines:
        if line.startswith("|"):
            if table_start is None:
                table_start = offset
            table_end = offset + len(line)
        elif table_start is not None:
            break
        offset += len(line)
    if table_start is None or table_end is None:
        raise SystemExit(f"the {SECTION!r} section of {DOC.name} has no table")
    return table_start, table_end


def listed_rows(doc: str) -> list[Row]:
    """The rows the document's table has now (header and separator skipped)."""
    start, end = section_bounds(doc)
    rows = []
    for line in doc[start:end].splitlines():
        cells = [cell.strip() for cell in _CELL_SPLIT.split(line.strip().strip("|"))]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue  # the header, the separator
        lines = cells[1].lstrip("~").replace(",", "")
        rows.append(
            Row(
                path=cells[0].strip("`"),
                lines=int(lines) if lines.isdigit() else -1,
                reason=" | ".join(cells[2:]).strip(),
            )
        )
    return rows


def _reason_for(path: str, listed: list[Row]) -> str:
    """The reason the document gives ``path``: its own row's, else that of the one row whose
    path ends it (a row written with a short path, ``kv_file/catalog.py``)."""
    for row in listed:
        if row.path == path:
            return row.reason
    by_suffix = [row for row in listed if path.endswith("/" + row.path)]
    return by_suffix[0].reason if len(by_suffix) == 1 else ""


def regenerated(sizes: dict[str, int], listed: list[Row]) -> list[Row]:
    """The table as it should be: every module over the limit, with the reason it has."""
    return [
        Row(path, lines, _reason_for(path, listed))
        for path, lines in sorted(sizes.items())
        if lines > LIMIT
    ]


def problems(sizes: dict[str, int], listed: list[Row]) -> list[str]:
    """What is wrong with the table, one line each (empty when it is right)."""
    found = []
    by_path = {row.path: row for row in listed}
    for path, lines in sorted(sizes.items()):
        if lines <= LIMIT:
            continue
        row = by_path.get(path)
        if row is None:
            found.append(f"`{path}` has {lines} lines (over {LIMIT}) and no row")
        elif not row.reason:
            found.append(f"`{path}` ({lines} lines) has no reason why it stays one module")
    for row in listed:
        real = sizes.get(row.path)
        if real is None:
            found.append(f"`{row.path}` is listed but is not a package module")
        elif real <= LIMIT:
            found.append(f"`{row.path}` is listed but has {real} lines (not over {LIMIT})")
        elif row.lines < 0 or abs(row.lines - real) > TOLERANCE * real:
            found.append(
                f"`{row.path}` is listed with {row.lines} lines but has {real} "
                f"(more than {TOLERANCE:.0%} off)"
            )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 naming what is wrong")
    mode.add_argument("--write", action="store_true", help=f"rewrite the table in {DOC.name}")
    args = parser.parse_args(argv)
    doc = DOC.read_text(encoding="utf-8")
    sizes, listed = module_lines(), listed_rows(doc)
    if args.check:
        wrong = problems(sizes, listed)
        for line in wrong:
            print(f"{DOC.relative_to(ROOT)}, {SECTION}: {line}", file=sys.stderr)
        if wrong:
            print("regenerate it: python scripts/module_sizes.py --write", file=sys.stderr)
        return 1 if wrong else 0
    rows = regenerated(sizes, listed)
    table = "\n".join([HEADER, *(row.markdown() for row in rows)]) + "\n"
    if args.write:
        start, end = section_bounds(doc)
        DOC.write_text(doc[:start] + table + doc[end:], encoding="utf-8")
        missing = [row.path for row in rows if not row.reason]
        if missing:
            print(f"write a reason for: {', '.join(missing)}", file=sys.stderr)
    else:
        sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
