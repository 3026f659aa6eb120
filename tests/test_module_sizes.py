"""docs/architecture.md's "Module sizes" table holds: every package module over 500 lines is
listed with the reason it stays one module, and no row is stale (scripts/module_sizes.py).

A long module is allowed when its parts share one job; the table is where that is argued, so a
module that grows past the limit without a reason, or a row that no longer matches the code,
fails here. The fix is ``python scripts/module_sizes.py --write`` and a reason for each new row.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "module_sizes", ROOT / "scripts" / "module_sizes.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("module_sizes", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sizes_script = _load_script()
Row = sizes_script.Row
LIMIT = sizes_script.LIMIT


def test_the_table_lists_every_module_over_the_limit_with_a_reason() -> None:
    doc = sizes_script.DOC.read_text(encoding="utf-8")
    wrong = sizes_script.problems(sizes_script.module_lines(), sizes_script.listed_rows(doc))
    assert wrong == [], (
        "docs/architecture.md, Module sizes:\n  "
        + "\n  ".join(wrong)
        + "\nregenerate it with `python scripts/module_sizes.py --write` and give each new row "
        "its reason"
    )


def test_tests_and_small_modules_are_not_counted() -> None:
    sizes = sizes_script.module_lines()
    assert "kvcore/backend.py" in sizes and "kvcore/__init__.py" in sizes
    assert not any(sizes_script.is_test(Path(path)) for path in sizes)
    assert all(path.endswith(".py") for path in sizes)


# -- the check itself: each kind of wrong row is named for what it is ------------------------

BIG = LIMIT + 100


def test_a_module_over_the_limit_without_a_row_is_named() -> None:
    wrong = sizes_script.problems({"kvcore/big.py": BIG, "kvcore/small.py": 10}, [])
    assert wrong == [f"`kvcore/big.py` has {BIG} lines (over {LIMIT}) and no row"]


def test_a_row_without_a_reason_is_named() -> None:
    wrong = sizes_script.problems({"kvcore/big.py": BIG}, [Row("kvcore/big.py", BIG, "")])
    assert wrong == [f"`kvcore/big.py` ({BIG} lines) has no reason why it stays one module"]


def test_a_module_back_under_the_limit_is_a_stale_row() -> None:
    row = Row("kvcore/was_big.py", BIG, "one job")
    wrong = sizes_script.problems({"kvcore/was_big.py": LIMIT}, [row])
    assert wrong == [f"`kvcore/was_big.py` is listed but has {LIMIT} lines (not over {LIMIT})"]
    gone = sizes_script.problems({}, [row])
    assert gone == ["`kvcore/was_big.py` is listed but is not a package module"]


def test_a_count_more_than_ten_percent_off_is_named_and_one_within_is_not() -> None:
    real = 1000
    within = [Row("kvcore/big.py", real + 100, "one job")]  # exactly 10 % off
    assert sizes_script.problems({"kvcore/big.py": real}, within) == []
    off = [Row("kvcore/big.py", real - 101, "one job")]
    assert sizes_script.problems({"kvcore/big.py": real}, off) == [
        f"`kvcore/big.py` is listed with {real - 101} lines but has {real} (more than 10% off)"
    ]


def test_regenerating_keeps_each_reason_and_parses_back() -> None:
    listed = [
        Row("kvcore/big.py", 900, "the one job"),
        Row("kv_file/catalog.py", 600, "a short path keeps its reason"),  # written short
        Row("kvcore/was_big.py", 700, "gone below the limit"),
    ]
    sizes = {
        "kvcore/big.py": 950,
        "plugins/kv_file/kv_file/catalog.py": 620,
        "kvcore/was_big.py": 300,
        "kvcore/new.py": 510,
    }
    rows = sizes_script.regenerated(sizes, listed)
    assert rows == [
        Row("kvcore/big.py", 950, "the one job"),
        Row("kvcore/new.py", 510, ""),
        Row("plugins/kv_file/kv_file/catalog.py", 620, "a short path keeps its reason"),
    ]
    table = "\n".join([sizes_script.HEADER, *(row.markdown() for row in rows)])
    doc = f"# Doc\n\n{sizes_script.SECTION}\n\nSome text:\n\n{table}\n\nAfter.\n\n## Next\n"
    assert sizes_script.listed_rows(doc) == rows
