"""Every option explains itself (help, default, choices); invalid values are refused; an invalid
value from an environment variable names the variable."""

from __future__ import annotations

import argparse
import json

import pytest
from test_cli import kvcore_cli

from kvcore.cli import _parser
from kvcore.cli.errors import ExitCode
from kvcore.registry import available_backends


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
    ]


def test_every_option_has_help_and_states_its_default():
    top = _parser()
    parsers = {"kvcore": top, **_subparsers(top)}
    assert set(parsers) == {
        "kvcore",
        "backends",
        "demo",
        "bench",
        "check",
        "events",
        "replay",
        "stats",
        "clear",
    }
    for command, parser in parsers.items():
        for action in _options(parser):
            name = "/".join(action.option_strings) or action.dest
            assert action.help and len(action.help) > 10, f"{command} {name} has no help"
            stated = "default" in action.help
            flag = isinstance(action, (argparse._StoreTrueAction, argparse._CountAction)) or (
                action.nargs == 0
            )
            positional = not action.option_strings
            assert stated or flag or positional, f"{command} {name}: no default stated"


def test_backend_options_list_the_installed_backends():
    names = sorted({b.name for b in available_backends()})
    subs = _subparsers(_parser())
    for command in ("demo", "bench"):
        backend = next(a for a in _options(subs[command]) if a.dest == "backend")
        assert all(n in backend.help for n in names), backend.help
    check_name = next(a for a in _options(subs["check"]) if a.dest == "name")
    assert all(n in check_name.help for n in names)


def test_help_output_shows_defaults_and_choices():
    out = kvcore_cli("demo", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())  # argparse wraps lines
    assert "--conversations CONVERSATIONS conversations replayed side by side (default: 8)" in text
    assert "(default: 6)" in text and "(default: file)" in text
    assert "one of: " in text and "memory" in text
    bench = " ".join(kvcore_cli("bench", "--help").stdout.split())
    assert "(default: 64)" in bench and "(default: 5)" in bench and "FILE.png" in bench


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("demo", "--turns", "-3"), ("--turns", "-3")),
        (("demo", "--conversations", "0"), ("--conversations", "0")),
        (("demo", "--seed", "x"), ("--seed", "'x'")),
        (("demo", "--metrics-port", "70000"), ("--metrics-port", "70000")),
        (("bench", "--blocks", "0"), ("--blocks", "0")),
        (("bench", "--repeats", "1.5"), ("--repeats", "'1.5'")),
        (("check",), ("NAME",)),
    ],
)
def test_invalid_option_values_are_refused(args, words):
    out = kvcore_cli(*args)
    assert out.returncode == ExitCode.USAGE, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcore: error: "), lines
    assert all(w in lines[0] for w in words), lines[0]
    assert out.stdout == ""  # nothing ran


def test_an_invalid_environment_value_names_the_variable(tmp_path):
    env = {"KVCORE_FILE_CAPACITY_BYTES": "lots", "KVCORE_LOG_DIR": str(tmp_path)}
    cfg = json.dumps({"root": str(tmp_path / "store")})
    out = kvcore_cli("demo", "--config", cfg, env=env)
    assert out.returncode == ExitCode.CONFIG, out.stderr
    line = out.stderr.strip().splitlines()[0]
    assert line.startswith("kvcore: error: ")
    assert "capacity_bytes (environment variable KVCORE_FILE_CAPACITY_BYTES)" in line
    assert len(out.stderr.strip().splitlines()) <= 2  # the error, and maybe where the log is


def test_a_transfer_setting_from_the_environment_names_its_variable(tmp_path):
    env = {"KVCORE_TRANSFER_READ_WORKERS": "0", "KVCORE_LOG_DIR": str(tmp_path)}
    out = kvcore_cli("demo", "--backend", "memory", env=env)
    assert out.returncode == ExitCode.CONFIG, out.stderr
    assert "read_workers (environment variable KVCORE_TRANSFER_READ_WORKERS)" in out.stderr
