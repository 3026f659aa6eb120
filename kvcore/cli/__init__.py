"""The ``kvcore`` command: backends, demo, bench, check, events.

Errors are one line, ``kvcore: error: <what went wrong>``, with an exit code per kind of error
(:class:`kvcore.cli.errors.ExitCode`); ``--debug`` or ``KVCORE_DEBUG=1`` adds the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from typing import Any, NoReturn

from kvcore.cli.console import LOG_DIR_ENV, CommandConsole, make_console, quiet_stderr
from kvcore.cli.errors import ExitCode, classify
from kvcore.cli.options import add_config_option, load_config_arg

__all__ = ["DEBUG_ENV", "load_config_arg", "main"]

#: set to 1 for tracebacks on errors (the same as --debug)
DEBUG_ENV = "KVCORE_DEBUG"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"kvcore: error: {message} (see `{self.prog} --help`)\n")
        sys.exit(ExitCode.USAGE)


def _int_at_least(minimum: int, maximum: int | None = None) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    parse.__name__ = "integer"  # what argparse calls the type in its messages
    return parse


def _count_option(
    parser: argparse.ArgumentParser,
    flag: str,
    minimum: int,
    maximum: int | None,
    default: int | None,
    help_text: str,
    **extra: Any,
) -> None:
    """An integer option from ``minimum`` to ``maximum`` (None: no upper bound); the help
    says its default, which argparse fills in."""
    if default is not None:
        help_text += " (default: %(default)s)"
    parser.add_argument(
        flag, type=_int_at_least(minimum, maximum), default=default, help=help_text, **extra
    )


def _installed_names() -> str:
    from kvcore.registry import available_backends

    try:
        names = sorted({b.name for b in available_backends()})
    except Exception:  # listing must never stop --help
        return "see `kvcore backends`"
    return ", ".join(names) if names else "none installed"


class _VersionAction(argparse.Action):
    """``kvcore --version``: one line per distribution, kvcore first."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from kvcore.versions import kvcore_distributions

        width = max(len(name) for name, _ in kvcore_distributions())
        lines = [f"{name:<{width}}  {version}" for name, version in kvcore_distributions()]
        sys.stdout.write("\n".join(lines) + "\n")
        parser.exit()


def _parser() -> _Parser:
    installed = _installed_names()
    p = _Parser(
        prog="kvcore",
        description="Third-tier KV-cache storage for LLM serving engines.",
        epilog=f"Exit codes and environment variables: docs/operator-guide.md. "
        f"Set {DEBUG_ENV}=1 for tracebacks.",
    )
    p.add_argument(
        "--version",
        action=_VersionAction,
        help="print kvcore's version and every installed backend's and adapter's, and exit",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="kvcore's info logs on the terminal (-v), debug logs (-vv) (default: warnings only)",
    )
    p.add_argument(
        "--debug",
        action="store_true",
        help=f"print the traceback of an error (also: {DEBUG_ENV}=1)",
    )
    p.add_argument(
        "--log-file",
        metavar="PATH",
        default=None,
        help="where demo, bench and check send other libraries' output (native log lines, "
        f"warnings) (default: a new file under ${LOG_DIR_ENV} or "
        "~/.local/state/kvcore/logs, removed when empty)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser(
        "backends",
        help="list installed backends and check each one's definition",
        description="List installed backends. Each is imported and its class and hooks are "
        "checked as opening would check them; --open also opens it with its default config "
        "(that may contact the server its config or environment names).",
    )
    b.add_argument("--json", action="store_true", help="machine-readable output")
    b.add_argument(
        "--open",
        action="store_true",
        help="also open each backend (default config, environment overrides, a small layout) "
        "and report what opening says, e.g. a missing vendor SDK or an unreachable server",
    )

    def backend_command(
        name: str, what: str, *, help: str, description: str
    ) -> argparse.ArgumentParser:
        """A command that runs on one backend: ``--backend``, ``--config`` and the rest."""
        sp = sub.add_parser(name, help=help, description=description)
        sp.add_argument(
            "--backend",
            default="file",
            metavar="NAME",
            help=f"backend to {what}, one of: {installed} (default: %(default)s)",
        )
        add_config_option(sp, detail="environment variables override it")
        sp.add_argument(
            "--namespace",
            default=None,
            help=f"namespace of the keys this run writes (default: a new kvcore-{sp.prog.split()[-1]}"
            "-<random> per run, so runs never see each other's data)",
        )
        sp.add_argument(
            "--keep",
            action="store_true",
            help="keep the data this run wrote (default: remove it at the end through the "
            "backend's clear hook)",
        )
        sp.add_argument("--json", action="store_true", help="print the summary as one JSON object")
        return sp

    d = backend_command(
        "demo",
        "run the workload on",
        help="replay a multi-turn chat workload through a backend, every byte verified",
        description="Replay conversations that share a system prompt and grow turn by turn "
        "through the TransferManager: each turn restores the stored prefix, verifies every "
        "restored byte, computes the rest and writes it back.",
    )
    _count_option(d, "--conversations", 1, 1000, 8, "conversations replayed side by side")
    _count_option(d, "--turns", 1, 100, 6, "turns per conversation")
    _count_option(d, "--seed", 0, None, 0, "seed of the token streams")
    _count_option(
        d,
        "--metrics-port",
        0,
        65535,
        None,
        "serve the run's Prometheus metrics on 127.0.0.1:PORT/metrics while it runs "
        "(0: any free port) (default: no endpoint)",
        metavar="PORT",
    )

    bench = backend_command(
        "bench",
        "measure",
        help="backend throughput through kvcore beside same-run baselines",
        description="Write, query and read blocks of the typical layout (28 layers x 8 heads x "
        "64 tokens x 128 dim, bfloat16: 7 MiB per block) through kvcore, beside memcpy and "
        "the backend's own raw baseline measured in the same run.",
    )
    _count_option(bench, "--blocks", 1, 4096, 64, "blocks per operation, 7 MiB each")
    _count_option(bench, "--repeats", 1, 1000, 5, "repetitions; figures are their medians")
    bench.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="also draw the figures against their baselines into FILE.png (needs matplotlib: "
        "pip install 'kvcore[plot]') (default: no chart)",
    )

    r = sub.add_parser(
        "replay",
        help="replay a production trace through a store: hit rate per byte of capacity",
        description="Serve a request trace (Mooncake JSONL) through the TransferManager and a "
        "backend with real bytes, or through a model of kv_file's store (--simulate), at one "
        "or more capacities and admission policies. Reports the prefix hit rate against the "
        "trace's maximum and the offline optimum (Belady's) at each capacity, bytes written "
        "per block hit, evictions and read latency.",
    )
    r.add_argument(
        "--backend",
        default="file",
        metavar="NAME",
        help=f"backend of an I/O replay, one with a capacity_bytes setting (default: "
        f"%(default)s; installed: {installed})",
    )
    add_config_option(
        r,
        detail="the replay sets its capacity, watermarks and admission, and writes under a "
        "fresh namespace removed at the end",
    )
    r.add_argument("--json", action="store_true", help="print the report as one JSON object")
    from kvcore.cli.replay import add_arguments as add_replay_arguments

    add_replay_arguments(r)

    st = sub.add_parser(
        "stats",
        help="kvcore's figures from an engine's Prometheus endpoint, or from a store",
        description="Scrape a kvcore Prometheus endpoint once (an engine's /metrics with "
        "kvcore's collector, or kvcore.metrics.serve_prometheus), or open a backend for its "
        "own figures, and print them per operation, per tenant and as gauges.",
    )
    from kvcore.cli.stats import add_arguments as add_stats_arguments

    add_stats_arguments(st)

    cl = sub.add_parser(
        "clear",
        help="delete a tenant's objects (--tenant), or a namespace's, from a store",
        description="Delete every object a tenant stored, of every namespace and every process "
        "sharing the store, crash-safe (--tenant); or every object of a namespace.",
    )
    from kvcore.cli.clear import add_arguments as add_clear_arguments

    add_clear_arguments(cl)

    c = sub.add_parser(
        "check",
        help="run the conformance kit against an installed backend",
        description="Open the backend once (stopping there, with the reason, if it cannot "
        "open), then run the conformance kit against it and summarise.",
    )
    c.add_argument("name", metavar="NAME", help=f"backend to check, one of: {installed}")
    add_config_option(c)
    c.add_argument(
        "-k",
        dest="keyword",
        default=None,
        metavar="EXPR",
        help="only the kit's tests matching this pytest -k expression (default: all)",
    )
    e = sub.add_parser(
        "events",
        help="follow a store's events (stored, removed, evicted, cleared) as JSON lines",
        description="Open a backend for one namespace and print each event of its stream as "
        "one JSON object per line (kvcore.events.StoreEvent): what a router's index would "
        "follow. kv_file reports every change in its directory, whoever makes it.",
    )
    e.add_argument("name", metavar="NAME", help=f"backend to follow, one of: {installed}")
    add_config_option(e)
    e.add_argument(
        "--namespace",
        default="default",
        help="the namespace whose events to follow (default: %(default)s, an engine's default)",
    )
    _count_option(e, "--count", 1, None, None, "stop after this many events (default: never)")
    e.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this long (default: never; Ctrl-C stops too)",
    )
    _count_option(
        e,
        "--max-queue",
        1,
        None,
        1 << 20,
        "objects queued before a slow reader gets one `resync` event instead",
    )
    return p


def _debug_requested(args: argparse.Namespace | None) -> bool:
    env = os.environ.get(DEBUG_ENV, "").strip().lower() in {"1", "true", "yes", "on"}
    return env or bool(args is not None and getattr(args, "debug", False))


def _runner(command: str) -> Any:
    if command == "backends":
        from kvcore.cli.backends import run
    elif command == "demo":
        from kvcore.cli.demo import run
    elif command == "bench":
        from kvcore.cli.bench import run
    elif command == "events":
        from kvcore.cli.events import run
    elif command == "replay":
        from kvcore.cli.replay import run
    elif command == "stats":
        from kvcore.cli.stats import run
    elif command == "clear":
        from kvcore.cli.clear import run
    else:
        from kvcore.cli.check import run
    return run


def main(argv: list[str] | None = None) -> int:
    # Paddle's CPU wheel warns about a missing compiler cache on import: noise for users
    warnings.filterwarnings("ignore", message="No ccache found")
    args = _parser().parse_args(argv)
    console: CommandConsole | None = None
    try:
        run = _runner(args.command)
        if args.command == "backends":
            console = CommandConsole(out=make_console(sys.stdout), err=make_console(sys.stderr))
            return int(run(args, console))
        with quiet_stderr(args.command, args.log_file, args.verbose) as console:
            code = int(run(args, console))
        if console.log_has_content():
            sys.stderr.write(f"kvcore: log of this run: {console.log_path}\n")
        return code
    except (Exception, KeyboardInterrupt) as exc:
        code, message = classify(exc)
        if _debug_requested(args):
            traceback.print_exception(exc)
        sys.stderr.write(f"kvcore: error: {message}\n")
        if console is not None and console.log_has_content():
            sys.stderr.write(f"kvcore: log of this run: {console.log_path}\n")
        return int(code)


if __name__ == "__main__":
    sys.exit(main())
