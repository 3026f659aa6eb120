"""The CLI's output without rich (``pip install "kvcore[cli]"`` adds it): plain-text stand-ins for
the few parts of rich's ``Console`` and ``Table`` the commands use.

The commands print the same lines either way; only the styling, the table rules and the
progress bar (:func:`kvcore.cli.console.step_progress` prints a line per tenth of the work
instead) need rich. Style arguments rich understands are accepted and ignored.
"""

from __future__ import annotations

import json
from typing import IO, Any

__all__ = ["Console", "Table"]


class Table:
    """Rows of text in aligned columns, two blanks apart, the header first."""

    def __init__(self, **_style: Any) -> None:
        self._headers: list[str] = []
        self._right: list[bool] = []
        self._min_widths: list[int] = []
        self._rows: list[tuple[str, ...]] = []

    def add_column(
        self, header: str, *, justify: str = "left", min_width: int | None = None, **_style: Any
    ) -> None:
        self._headers.append(header)
        self._right.append(justify == "right")
        self._min_widths.append(min_width or 0)

    def add_row(self, *cells: str) -> None:
        self._rows.append(tuple(str(cell) for cell in cells))

    def render(self) -> str:
        rows = [tuple(self._headers), *self._rows]
        widths = [
            max(self._min_widths[i], *(len(row[i]) for row in rows))
            for i in range(len(self._headers))
        ]
        lines = []
        for row in rows:
            cells = [
                cell.rjust(width) if right else cell.ljust(width)
                for cell, width, right in zip(row, widths, self._right, strict=True)
            ]
            lines.append("  ".join(cells).rstrip())  # no trailing blanks for grep and diff
        return "\n".join(lines)


class Console:
    """Writes text to ``file``; a :class:`Table` as its rendered lines."""

    def __init__(self, file: IO[str], **_style: Any) -> None:
        self.file = file
        self.is_terminal = file.isatty()

    def print(self, *objects: Any, sep: str = " ", end: str = "\n", **_style: Any) -> None:
        text = sep.join(o.render() if isinstance(o, Table) else str(o) for o in objects)
        self.file.write(text + end)
        self.file.flush()

    def print_json(self, text: str) -> None:
        self.print(json.dumps(json.loads(text), indent=2))  # rich's layout, without the colours
