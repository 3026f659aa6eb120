"""Every backend plugin logs under ``kvcore.``: the CLI shows the warnings of the ``kvcore`` logger
and its children on the terminal (kvcore/cli/console.py), and an engine that configures
``kvcore`` gets its backends' lines with it. A logger named after the plugin's own module
(``getLogger(__name__)``: ``kv_mooncake.backend``) would be hidden from both."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(ROOT.glob("plugins/kv_*/kv_*"))


def logger_names(path: Path) -> list[tuple[int, str | None]]:
    """(line, name) of each ``getLogger(...)`` call in ``path``; name None where it is not a
    string literal (``__name__``, a variable, no argument: the root logger)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called != "getLogger":
            continue
        arg = node.args[0] if node.args else None
        name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
        found.append((node.lineno, name))
    return found


def test_the_four_backend_plugins_are_found() -> None:
    names = {p.name for p in PLUGINS}
    assert {"kv_file", "kv_mooncake", "kv_attentionstore", "kv_tiered"} <= names, names


def test_every_logger_of_a_backend_plugin_is_under_kvcore() -> None:
    wrong, seen = [], 0
    for package in PLUGINS:
        for path in sorted(package.rglob("*.py")):
            for line, name in logger_names(path):
                seen += 1
                if name is None or not name.startswith("kvcore."):
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {name or 'not a literal'}")
    assert seen, "no getLogger call found: has the plugins' layout changed?"
    assert not wrong, f"loggers not under kvcore. (e.g. kvcore.<backend>): {wrong}"
