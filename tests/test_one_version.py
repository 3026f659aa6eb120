"""One version: the release being prepared is named once, and everything that names a release
agrees with it (issue 59: 37 markers said 0.4 while pyproject.toml and the CHANGELOG said 0.3.0).

- ``pyproject.toml``'s version is the CHANGELOG's newest heading;
- no ``versionadded``/``versionchanged``/``deprecated`` marker in the packages' sources names a
  release after it (the markers name kvcore's releases, in the backends and adapters too).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"\.\. (versionadded|versionchanged|deprecated):: (\d+)\.(\d+)")


def _version() -> str:
    """pyproject.toml's ``version`` (read by pattern: tomllib is not in Python 3.10)."""
    found = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert found, "pyproject.toml names no version"
    return found.group(1)


def _release() -> tuple[int, int]:
    major, minor = _version().split(".")[:2]
    return int(major), int(minor)


def _sources() -> list[Path]:
    roots = [ROOT / "kvcore", *ROOT.glob("plugins/*/kv_*"), *ROOT.glob("integrations/*/kvcore_*")]
    return sorted(p for r in roots for p in r.rglob("*.py"))


def test_the_changelog_names_the_version_being_released() -> None:
    version = _version()
    newest = next(
        line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## ")
    )
    assert newest.startswith(f"## {version} "), (newest, version)


def test_no_marker_names_a_release_after_the_one_being_prepared() -> None:
    release = _release()
    later = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in _sources()
        for match in MARKER.finditer(path.read_text(encoding="utf-8"))
        if (int(match.group(2)), int(match.group(3))) > release
    ]
    assert not later, f"markers name a release after {release}: {later}"
    assert len(_sources()) > 100  # the walk found the packages
