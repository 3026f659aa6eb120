"""Which of kvcore's native extensions this install has, found in one place.

A wheel carries both (``kvcore._swap``: the swap ops; ``kvcore._fileio``: whole-file I/O and
its checksums). A build from source on a machine without a C++ compiler installs without them
(``setup.py`` says so as it builds) and runs the same operations in Python: the swap ops in
:mod:`kvcore._swap_py`, file backends on their own Python I/O path. This module is what the
rest of kvcore imports them through, so that choice is made once; :func:`describe` reports it.

An extension that is there but fails to load (a broken build, a missing library) is an error,
never a silent fallback.

.. versionadded:: 0.3
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["NATIVE_ENV", "describe", "extension", "file_ops", "swap_ops", "swap_ops_native"]

#: ``KVCORE_NATIVE`` at build time: ``1`` requires the extensions (a build without a compiler
#: fails, as a release build should), ``0`` builds none, anything else (the default) builds
#: them when a compiler is found and else installs the Python fallback.
NATIVE_ENV = "KVCORE_NATIVE"


def extension(name: str) -> ModuleType | None:
    """The extension module ``kvcore.<name>``, or None where this install was built without it.

    Raises what importing it raises for any other reason."""
    qualified = f"kvcore.{name}"
    try:
        return importlib.import_module(qualified)
    except ModuleNotFoundError as exc:
        if exc.name != qualified:  # the module is there but needs something that is not
            raise
        return None


_swap_native = extension("_swap")
if _swap_native is None:
    from kvcore import _swap_py as _swap_fallback

    swap_ops: ModuleType = _swap_fallback
else:
    swap_ops = _swap_native
#: Whether the swap ops run the C++ extension (False: :mod:`kvcore._swap_py`).
swap_ops_native: bool = _swap_native is not None
#: ``kvcore._fileio``, or None: file backends then take their Python I/O path.
file_ops: ModuleType | None = extension("_fileio")


def describe() -> str:
    """Which native extensions run, in one line for operators (``kvcore backends``)."""
    if swap_ops_native and file_ops is not None:
        return "native extensions: swap ops and file I/O in C++"
    missing = [
        what
        for what, native in (("swap ops", swap_ops_native), ("file I/O", file_ops is not None))
        if not native
    ]
    return (
        f"native extensions: absent ({' and '.join(missing)} in Python: kvcore was built "
        "without a C++ compiler; install kvcore's wheel, or rebuild with a compiler on PATH)"
    )
