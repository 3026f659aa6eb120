"""The plugin SDK is declared, and plugins, adapters and benchmarks use only it (issue 37).

Every name a backend plugin, an engine adapter or a benchmark imports from kvcore must be in
the ``__all__`` of a module of the SDK (docs/writing-a-backend.md, "The plugin SDK"): what a
third party may build on is what kvcore promises to keep, and nothing else leaks into it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: the modules of the SDK: what plugins, adapters and benchmarks may import from
SDK_MODULES = (
    "kvcore",
    "kvcore.admission",
    "kvcore.config",
    "kvcore.errors",
    "kvcore.estimates",
    "kvcore.events",
    "kvcore.evictions",
    "kvcore.fileio",
    "kvcore.handles",
    "kvcore.integrity",
    "kvcore.keys",
    "kvcore.load_costs",
    "kvcore.ops",
    "kvcore.prefill_profile",
    "kvcore.registry",
    "kvcore.replay",
    "kvcore.requests",
    "kvcore.runner",
    "kvcore.schemas",
    "kvcore.tasks",
    "kvcore.tenants",
    "kvcore.testing",
    "kvcore.testing.corruption",
    "kvcore.testing.harness",
    "kvcore.testing.identity",
    # the kit's mixins, one module per capability (a backend's tests may compose some)
    "kvcore.testing.kit",
    "kvcore.testing.kit.buffers",
    "kvcore.testing.kit.capacity",
    "kvcore.testing.kit.data",
    "kvcore.testing.kit.deadlines",
    "kvcore.testing.kit.events",
    "kvcore.testing.kit.evictions",
    "kvcore.testing.kit.fixtures",
    "kvcore.testing.kit.inputs",
    "kvcore.testing.kit.lifecycle",
    "kvcore.testing.kit.marks",
    "kvcore.testing.kit.removal",
    "kvcore.testing.kit.runs",
    "kvcore.testing.kit.sharing",
    "kvcore.testing.kit.verification",
    "kvcore.testing.suite",
    "kvcore.threads",
    "kvcore.transfer",
    "kvcore.versions",
    # the CLI's pieces benchmarks reuse (their reports and plots)
    "kvcore.cli.bench",
    "kvcore.cli.errors",
    "kvcore.cli.plot",
)

SOURCES = sorted(
    [
        *ROOT.glob("plugins/*/kv_*/**/*.py"),
        *ROOT.glob("integrations/*/kvcore_*/**/*.py"),
        *ROOT.glob("benchmarks/*.py"),
    ]
)


def _kvcore_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every ``from kvcore... import name`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "kvcore"
        ):
            found += [(node.lineno, str(node.module), a.name) for a in node.names]
    return found


def test_every_sdk_module_declares_its_names() -> None:
    missing = [m for m in SDK_MODULES if not hasattr(importlib.import_module(m), "__all__")]
    assert not missing, f"SDK modules without __all__: {missing}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_adapters_and_benchmarks_use_only_the_sdk(path: Path) -> None:
    wrong = []
    for line, module, name in _kvcore_imports(path):
        if module not in SDK_MODULES:
            wrong.append(f"{line}: {module} is not an SDK module")
            continue
        imported = importlib.import_module(module)
        declared = getattr(imported, "__all__", ())
        is_submodule = hasattr(imported, "__path__") and f"{module}.{name}" in SDK_MODULES
        if name not in declared and not is_submodule:
            wrong.append(f"{line}: {module}.{name} is not in {module}.__all__")
    assert not wrong, "\n".join(wrong)
