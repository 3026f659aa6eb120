"""``kvcore backends``: what is installed, and what opening each one would say.

Without ``--open`` nothing is opened (no server is contacted): each backend is imported and
its class checked as :func:`kvcore.open_backend` checks it - ``config_model`` and
``capabilities``, then its hooks registered with pluggy (a misspelled hook, a missing required
hook). What only opening can tell (a vendor SDK imported by the constructor, an unreachable
server) is left to ``--open``, and the table says which of the two was checked.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from kvcore import fileio, native
from kvcore.cli.common import open_for_cli
from kvcore.cli.console import CommandConsole, Table, print_table, styled
from kvcore.cli.errors import classify
from kvcore.errors import BackendImportError, KVCoreError
from kvcore.registry import available_backends, check_backend_class, load_backend_class
from kvcore.schemas import BackendContext, CacheLayout

#: the layout backends are opened with by ``--open``: tiny, so that opening allocates little
PROBE_LAYOUT = CacheLayout(num_layers=1, num_heads=1, block_size=16, head_dim=64)

CHECKED_DEFINITION = "import, class, hooks (not opened)"
CHECKED_OPENED = "opened"


def check_hooks(name: str, cls: type) -> None:
    """The registry's own definition check (hooks registered with pluggy, as opening does),
    no instance (and so no server or SDK) needed."""
    check_backend_class(name)  # the class is imported already: this re-uses it


def describe(open_them: bool = False) -> list[dict[str, Any]]:
    infos = available_backends()
    claims = Counter(b.name for b in infos)
    rows = []
    for info in infos:
        row: dict[str, Any] = {
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "entry_point": info.value,
            "imports": False,
            "ok": False,
            "checked": "import",
            "capabilities": None,
            "error": None,
        }
        rows.append(row)
        if claims[info.name] > 1:
            row["error"] = "name claimed by several distributions (opening it names them)"
            continue
        try:
            cls = load_backend_class(info.name)
        except KVCoreError as exc:
            # the import itself succeeded when only the class's definition is wrong
            row["imports"] = not isinstance(exc, BackendImportError)
            row["error"] = classify(exc)[1]
            continue
        row["imports"] = True
        row["capabilities"] = cls.capabilities.model_dump()
        try:
            check_hooks(info.name, cls)
        except KVCoreError as exc:
            row["error"] = classify(exc)[1]
            continue
        row["checked"] = CHECKED_DEFINITION
        row["ok"] = True
        if open_them:
            row["checked"] = CHECKED_OPENED
            try:
                backend = open_for_cli(info.name, {}, BackendContext(layout=PROBE_LAYOUT))
            except Exception as exc:  # report it; the next backend is still listed
                row["ok"] = False
                row["error"] = classify(exc)[1]
            else:
                backend.close()
    return rows


def _capabilities(caps: dict[str, Any] | None) -> str:
    if not caps:
        return ""
    flags = [f"{caps['addressing']}-addressed", f"{caps['io']} I/O"]
    flags += [k for k in ("token_index", "persistent", "shared") if caps[k]]
    return ", ".join(flags)


def run(args: argparse.Namespace, console: CommandConsole) -> int:
    rows = describe(open_them=args.open)
    if args.json:
        console.out.print_json(json.dumps(rows))
        return 0
    if not rows:
        console.out.print("no kvcore backends installed (entry-point group kvcore.backends)")
        return 0
    table = Table(box=None, pad_edge=False, header_style="bold")
    # names and versions are never cut or wrapped, however long: a narrow terminal wraps the
    # descriptive columns instead
    for column, key in (("NAME", "name"), ("DISTRIBUTION", "distribution"), ("VERSION", "version")):
        width = max(len(column), *(len(str(r[key])) for r in rows))
        table.add_column(column, no_wrap=True, min_width=width)
    table.add_column("STATUS", no_wrap=True, min_width=len("STATUS"))
    table.add_column("CHECKED")
    table.add_column("CAPABILITIES")
    for r in rows:
        status = "ok" if r["ok"] else "error"
        table.add_row(
            r["name"],
            r["distribution"],
            r["version"],
            styled(status, "green" if r["ok"] else "red"),
            r["checked"],
            _capabilities(r["capabilities"]),
        )
    print_table(console.out, table)
    console.out.print(native.describe(), markup=False)
    console.out.print(fileio.describe(), markup=False)
    for r in rows:
        if r["error"]:
            console.out.print(f"{r['name']}: {r['error']}", markup=False)
    if not args.open:
        console.out.print(
            "Not opened: opening can still fail (a vendor SDK, a server); "
            "`kvcore backends --open` or `kvcore check NAME` tries it.",
            markup=False,
        )
    return 0
