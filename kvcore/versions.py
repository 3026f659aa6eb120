"""Versions, single-sourced: each package's version is its distribution's metadata (set in its
pyproject.toml), and ``kvcore --version`` lists the core's and every installed backend's and
adapter's."""

from __future__ import annotations

from importlib import metadata

__all__ = ["installed_version", "kvcore_distributions"]

#: what a source tree that was never installed reports
UNKNOWN = "0+unknown"


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` (:data:`UNKNOWN` when it is not installed,
    e.g. a checkout on ``sys.path`` without ``pip install``)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return UNKNOWN


def kvcore_distributions() -> list[tuple[str, str]]:
    """``(name, version)`` of kvcore and of every installed distribution that plugs into it:
    those publishing ``kvcore.backends`` entry points and those named ``kvcore-*`` (engine
    adapters), sorted by name, kvcore first."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        # the first Name header, as .get("Name") (typed only from Python 3.12 on) gives it
        name = (dist.metadata.get_all("Name") or [""])[0] or ""
        if not name:
            continue
        key = name.lower().replace("_", "-")
        backends = any(ep.group == "kvcore.backends" for ep in dist.entry_points)
        if key == "kvcore" or key.startswith("kvcore-") or backends:
            found.setdefault(key, dist.version)
    core = [("kvcore", found.pop("kvcore", UNKNOWN))]
    return core + sorted(found.items())
