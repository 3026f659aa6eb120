"""The CLI's terminal: rich consoles, progress for long steps, and third-party noise kept off.

rich is the ``cli`` extra (``pip install "kvcore[cli]"``); without it the commands print the same
lines in plain text (:mod:`kvcore.cli.plain`), and progress as a line per tenth of the work.

Native libraries (Mooncake's glog, Paddle) write to file descriptor 2 directly, so Python's
logging cannot hold them back. :func:`quiet_stderr` points descriptor 2 at a log file for the
duration of a command and gives kvcore a console on a duplicate of the real stderr: the
terminal shows kvcore's own lines, the log file keeps everything else.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kvcore.cli import plain

if TYPE_CHECKING:  # the types are rich's; plain's stand-ins have the parts the commands use
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table
else:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # installed without the `cli` extra
        Console, Table = plain.Console, plain.Table

__all__ = [
    "LOG_DIR_ENV",
    "RICH",
    "CommandConsole",
    "Console",
    "Table",
    "default_log_dir",
    "make_console",
    "print_table",
    "quiet_stderr",
    "step_progress",
    "styled",
]

#: whether rich draws the output (the `cli` extra); plain text otherwise
RICH = Table.__module__.startswith("rich.")

#: where per-run log files go unless ``--log-file`` names one
LOG_DIR_ENV = "KVCORE_LOG_DIR"
#: log files kept in the default directory (older ones are removed)
KEEP_LOGS = 20


def default_log_dir() -> Path:
    env = os.environ.get(LOG_DIR_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvcore" / "logs"


def make_console(stream: IO[str] | None = None) -> Console:
    """A rich console (plain text without rich); when the output is not a terminal (a pipe, a
    CI log), lines are not wrapped at 80 columns, so that tables stay one row per line for grep
    and for tests."""
    stream = stream or sys.stdout
    tty = stream.isatty()
    return Console(file=stream, width=None if tty else 200, soft_wrap=not tty, highlight=False)


def styled(text: str, style: str) -> str:
    """``text`` for a table cell or a line, in rich's ``style`` where rich draws the output."""
    if not RICH:
        return text
    from rich.markup import escape

    return f"[{style}]{escape(text)}[/]"


def print_table(console: Console, table: Any) -> None:
    """Print a rich table; off a terminal without the padding rich adds after the last column
    (trailing blanks in a log or a pipe only get in the way of grep and diff)."""
    if console.is_terminal or not RICH:  # plain tables never pad their last column
        console.print(table)
        return
    with console.capture() as captured:
        console.print(table)
    lines = captured.get().splitlines()
    console.file.write("".join(line.rstrip() + "\n" for line in lines))
    console.file.flush()


@dataclass
class CommandConsole:
    """Where a command writes: ``out`` (results, stdout), ``err`` (progress, warnings: the real
    stderr) and the log file that receives third-party output (None: not redirected)."""

    out: Console
    err: Console
    log_path: Path | None = None

    def log_has_content(self) -> bool:
        return (
            self.log_path is not None
            and self.log_path.exists()
            and self.log_path.stat().st_size > 0
        )


def _new_log_path(command: str) -> Path:
    directory = default_log_dir()
    directory.mkdir(parents=True, exist_ok=True)
    old = sorted(directory.glob("kvcore-*.log"), key=lambda p: p.stat().st_mtime)
    for stale in old[: max(0, len(old) - (KEEP_LOGS - 1))]:
        with contextlib.suppress(OSError):
            stale.unlink()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return directory / f"kvcore-{command}-{stamp}-{os.getpid()}.log"


@contextlib.contextmanager
def quiet_stderr(command: str, log_file: str | None, verbose: int) -> Iterator[CommandConsole]:
    """Send descriptor 2 (native libraries, Python warnings, other packages' logging) to a log
    file while the command runs; kvcore's own warnings still reach the terminal.

    An empty log file is removed at the end, so nothing is left when nothing was said.
    """
    try:
        path = Path(log_file).expanduser() if log_file else _new_log_path(command)
        path.parent.mkdir(parents=True, exist_ok=True)
        log_stream = open(path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    except OSError as exc:
        # a read-only home must not stop the command: the output just stays on the terminal
        sys.stderr.write(
            f"kvcore: warning: no log file ({exc}); other libraries' output stays on the "
            f"terminal (set --log-file or {LOG_DIR_ENV})\n"
        )
        yield CommandConsole(out=make_console(sys.stdout), err=make_console(sys.stderr))
        return
    sys.stderr.flush()
    saved_fd = os.dup(2)
    terminal = os.fdopen(saved_fd, "w", buffering=1, encoding="utf-8", errors="replace")
    os.dup2(log_stream.fileno(), 2)
    handlers = _route_logging(terminal, log_stream, verbose)
    try:
        yield CommandConsole(
            out=make_console(sys.stdout), err=make_console(terminal), log_path=path
        )
    finally:
        for logger, handler in handlers:
            logger.removeHandler(handler)
        sys.stderr.flush()
        os.dup2(saved_fd, 2)
        terminal.close()
        log_stream.close()
        if path.exists() and path.stat().st_size == 0:
            path.unlink()


def _route_logging(
    terminal: IO[str], log_stream: IO[str], verbose: int
) -> list[tuple[logging.Logger, logging.Handler]]:
    """Everything to the log file (info, or debug with -vv); kvcore's warnings, or its info with
    -v, also to the terminal."""
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    to_file = logging.StreamHandler(log_stream)
    to_file.setFormatter(fmt)
    to_file.setLevel(logging.DEBUG if verbose >= 2 else logging.INFO)
    to_terminal = logging.StreamHandler(terminal)
    to_terminal.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    to_terminal.setLevel((logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)])
    root = logging.getLogger()
    kvcore_logger = logging.getLogger("kvcore")
    root.addHandler(to_file)
    kvcore_logger.addHandler(to_terminal)
    root.setLevel(logging.DEBUG if verbose >= 2 else logging.INFO)
    return [(root, to_file), (kvcore_logger, to_terminal)]


class step_progress:  # used like a function: `with step_progress(...) as progress`
    """Progress of a long step on the error console: a rich bar on a terminal; in a log (no
    terminal) or without rich, one line per tenth of the work so a CI log shows it is moving."""

    def __init__(self, console: Console, description: str, total: int, unit: str) -> None:
        self.console = console
        self.description = description
        self.total = max(int(total), 1)
        self.unit = unit
        self.done = 0
        self._progress: Progress | None = None
        self._task: Any = None
        self._started = time.monotonic()
        self._last_tenth = -1

    def __enter__(self) -> step_progress:
        if self.console.is_terminal and RICH:
            # imported here: only a bar on a terminal needs it
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(self.unit),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[note]}"),
                console=self.console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total, note="")
        return self

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if self._progress is not None:
            self._progress.update(self._task, advance=n, note=note)
            return
        tenth = 10 * self.done // self.total
        if tenth != self._last_tenth or self.done >= self.total:
            self._last_tenth = tenth
            elapsed = time.monotonic() - self._started
            extra = f", {note}" if note else ""
            self.console.print(
                f"  {self.description}: {self.done}/{self.total} {self.unit}{extra}, {elapsed:.1f} s"
            )

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
