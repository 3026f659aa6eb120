"""Every module of kvcore has a place in the core's layers (docs/architecture.md, "Who may import
whom"): the ``core-layers`` contract of ``.importlinter`` names each one, the architecture doc lists
the same layers, and the ``runtime-knows-no-tools`` contract covers every module but the tools.

import-linter enforces the imports (``scripts/check-rules.sh``); these tests keep its contracts
complete, so that a new module cannot slip past them by being named in none.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what only people run: nothing else in kvcore may import them (replay is imported by the CLI)
TOOLS = {"cli", "testing", "replay", "__main__"}
HOW_TO_FIX = (
    "give each a layer in .importlinter's core-layers contract and in docs/architecture.md's "
    '"Who may import whom"; unless it is a tool, add it to the runtime-knows-no-tools contract'
)


def kvcore_packages() -> set[str]:
    return {p.parent.name for p in (ROOT / "kvcore").glob("*/__init__.py")}


def kvcore_modules() -> set[str]:
    """kvcore's top-level modules and packages as import-linter sees them: Python source (the
    native extensions, ``_swap`` and ``_fileio``, import nothing and are invisible to it)."""
    modules = {p.stem for p in (ROOT / "kvcore").glob("*.py") if p.stem != "__init__"}
    return modules | kvcore_packages()


def as_modules(names: set[str]) -> set[str]:
    """The contract's form of ``names`` (as_packages = False): each ``kvcore.<name>``, and a
    package's own modules as ``kvcore.<name>.**``."""
    packages = kvcore_packages()
    return {f"kvcore.{n}" for n in names} | {f"kvcore.{n}.**" for n in names & packages}


def contract(name: str) -> configparser.SectionProxy:
    config = configparser.ConfigParser()
    assert config.read(ROOT / ".importlinter"), "no .importlinter"
    return config[f"importlinter:contract:{name}"]


def contract_layers() -> list[set[str]]:
    """The layers of the ``core-layers`` contract, lowest first (the doc's order), each the set of
    its modules; an optional layer, ``(name)``, counts as its name."""
    lines = [line for line in contract("core-layers")["layers"].splitlines() if line.strip()]
    layers = [{name.strip().strip("()") for name in re.split(r"[:|]", line)} for line in lines]
    return layers[::-1]  # the contract lists the highest layer first


def doc_layers() -> list[set[str]]:
    """The numbered list of docs/architecture.md's "Who may import whom": each item's modules are
    the backquoted names before its dash."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Who may import whom", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^\d+\. (.*?)(?=^\d+\. |^\s*$)", section, flags=re.M | re.S)
    assert items, "no numbered list in the doc's section"
    return [
        {name.rstrip("/") for name in re.findall(r"`([^`]+)`", item.split(" — ", 1)[0])}
        for item in items
    ]


def test_every_module_of_kvcore_has_a_layer() -> None:
    placed = set().union(*contract_layers())
    missing = sorted(kvcore_modules() - placed)
    assert not missing, f"kvcore modules in no layer: {missing}; {HOW_TO_FIX}"
    assert contract("core-layers").getboolean("exhaustive"), "import-linter checks it too"


def test_every_layer_names_a_module_of_kvcore() -> None:
    optional = set(re.findall(r"\((\w+)\)", contract("core-layers")["layers"]))
    stale = sorted(set().union(*contract_layers()) - kvcore_modules() - optional)
    assert not stale, f"layers name modules kvcore no longer has: {stale}"


def test_the_architecture_doc_lists_the_contracts_layers() -> None:
    assert doc_layers() == contract_layers(), HOW_TO_FIX


def test_the_runtime_contract_covers_every_module_but_the_tools() -> None:
    runtime = contract("runtime-knows-no-tools")
    assert not runtime.getboolean("as_packages")  # so that kvcore itself can be a source
    sources = set(runtime["source_modules"].split())
    assert sources == {"kvcore"} | as_modules(kvcore_modules() - TOOLS), HOW_TO_FIX
    assert set(runtime["forbidden_modules"].split()) == as_modules(TOOLS - {"__main__"})
    # a chain through another module loads the tools all the same
    assert not runtime.getboolean("allow_indirect_imports", fallback=False)
