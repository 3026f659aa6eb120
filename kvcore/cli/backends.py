"""``kvcore backends``: what is installed, and whether each one imports."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from kvcore.errors import KVCoreError
from kvcore.registry import available_backends, load_backend_class


def describe() -> list[dict[str, Any]]:
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
            "capabilities": None,
            "error": None,
        }
        if claims[info.name] > 1:
            row["error"] = "name claimed by several distributions"
        else:
            try:
                cls = load_backend_class(info.name)
            except KVCoreError as exc:
                row["error"] = str(exc)
            else:
                row["imports"] = True
                row["capabilities"] = cls.capabilities.model_dump()
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    rows = describe()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no kvcore backends installed (entry-point group kvcore.backends)")
        return 0
    print(f"{'NAME':16} {'DISTRIBUTION':24} {'VERSION':9} {'IMPORTS':8} CAPABILITIES")
    for r in rows:
        caps = r["capabilities"]
        if caps:
            flags = [f"{caps['addressing']}-addressed", f"{caps['io']} I/O"]
            flags += [k for k in ("token_index", "persistent", "shared") if caps[k]]
            desc = ", ".join(flags)
        else:
            desc = f"error: {r['error']}"
        print(
            f"{r['name']:16} {r['distribution']:24} {r['version']:9} "
            f"{'yes' if r['imports'] else 'no':8} {desc}"
        )
    return 0
