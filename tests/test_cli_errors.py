"""CLI errors: one line, ``kvcore: error: ...``, and an exit code per kind; --debug adds the
traceback; ``check`` stops at a backend that cannot open; ``backends`` shows what opening
would say about a backend's definition without opening it."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
from fake_dist import BROKEN_IMPORT_BACKEND, MISSPELLED_BACKEND, UNDECORATED_BACKEND, make_dist
from test_cli import kvcore_cli

from kvcore.cli.errors import ExitCode


def _lines(out) -> list[str]:
    return (out.stdout + out.stderr).strip().splitlines()


def _one_error(out, code: int) -> str:
    """The run printed at most 3 lines, exited ``code``, and its error line is returned."""
    lines = _lines(out)
    assert out.returncode == code, out.stdout + out.stderr
    assert 1 <= len(lines) <= 3, lines
    errors = [line for line in lines if line.startswith("kvcore: error: ")]
    assert len(errors) == 1, lines
    assert "Traceback" not in out.stderr
    return errors[0]


# -- the "must show" ---------------------------------------------------------------


def test_check_of_an_unknown_backend_is_one_line(tmp_path):
    out = kvcore_cli("check", "nosuch", env={"KVCORE_LOG_DIR": str(tmp_path)})
    line = _one_error(out, ExitCode.UNKNOWN_BACKEND)
    assert "no kvcore backend named 'nosuch'" in line and "file" in line  # lists installed ones


@pytest.mark.skipif(
    importlib.util.find_spec("attentionstore_sdk") is not None,
    reason="the AttentionStore SDK is installed here: this test is about its absence",
)
def test_check_attentionstore_without_its_sdk_is_one_line(tmp_path):
    out = kvcore_cli("check", "attentionstore", env={"KVCORE_LOG_DIR": str(tmp_path)})
    line = _one_error(out, ExitCode.MISSING_DEPENDENCY)
    assert "AttentionStore SDK" in line and "attentionstore_sdk" in line


def test_demo_with_a_misspelled_config_field_is_one_line(tmp_path):
    out = kvcore_cli("demo", "--config", '{"rooot": 1}', env={"KVCORE_LOG_DIR": str(tmp_path)})
    line = _one_error(out, ExitCode.CONFIG)
    assert "rooot" in line and "Extra inputs are not permitted" in line


# -- the other error classes -----------------------------------------------------------------


def test_check_of_a_misspelled_hook_stops_before_the_kit(tmp_path):
    site = tmp_path / "site"
    make_dist(site, "typo-kv", "typo_kv", MISSPELLED_BACKEND, {"typo": "Backend"})
    out = kvcore_cli("check", "typo", site=site, env={"KVCORE_LOG_DIR": str(tmp_path)})
    line = _one_error(out, ExitCode.BACKEND_DEFINITION)
    assert "kvcore_raed" in line


def test_an_unreachable_mooncake_master_is_one_line(tmp_path):
    pytest.importorskip("mooncake.store", reason="Mooncake's wheel is not importable here")
    cfg = json.dumps({"master_server_address": "127.0.0.1:1", "connect_timeout_s": 2})
    out = kvcore_cli(
        "demo", "--backend", "mooncake", "--config", cfg, env={"KVCORE_LOG_DIR": str(tmp_path)}
    )
    line = _one_error(out, ExitCode.BACKEND_UNAVAILABLE)
    assert "127.0.0.1:1" in line and "unreachable" in line


def test_a_broken_import_is_a_missing_dependency(tmp_path):
    site = tmp_path / "site"
    make_dist(site, "gone-kv", "gone_kv", BROKEN_IMPORT_BACKEND, {"gone": "Backend"})
    out = kvcore_cli("bench", "--backend", "gone", site=site, env={"KVCORE_LOG_DIR": str(tmp_path)})
    line = _one_error(out, ExitCode.MISSING_DEPENDENCY)
    assert "not_installed_vendor_sdk" in line


def test_debug_flag_and_environment_variable_show_the_traceback(tmp_path):
    env = {"KVCORE_LOG_DIR": str(tmp_path)}
    for args, extra in (
        (("--debug", "check", "nosuch"), {}),
        (("check", "nosuch"), {"KVCORE_DEBUG": "1"}),
    ):
        out = kvcore_cli(*args, env={**env, **extra})
        assert out.returncode == ExitCode.UNKNOWN_BACKEND
        assert "Traceback (most recent call last)" in out.stderr
        assert "UnknownBackendError" in out.stderr
        assert out.stderr.strip().splitlines()[-1].startswith("kvcore: error: no kvcore backend")


def test_usage_errors_are_one_line_with_exit_2():
    out = kvcore_cli("demo", "--turns", "-3")
    line = _one_error(out, ExitCode.USAGE)
    assert "--turns" in line and "-3" in line
    assert "kvcore demo --help" in line
    assert _one_error(kvcore_cli("nosuchcommand"), ExitCode.USAGE)


# -- kvcore backends -------------------------------------------------------------------------


def test_backends_reports_definition_errors_without_opening(tmp_path):
    site = tmp_path / "site"
    make_dist(site, "typo-kv", "typo_kv", MISSPELLED_BACKEND, {"typo": "Backend"})
    make_dist(site, "bare-kv", "bare_kv", UNDECORATED_BACKEND, {"bare": "Backend"})
    make_dist(site, "gone-kv", "gone_kv", BROKEN_IMPORT_BACKEND, {"gone": "Backend"})
    make_dist(
        site,
        "a-backend-with-a-very-long-name",
        "long_kv",
        "from memory_backend import MemoryBackend as Backend\n",
        {"a-backend-with-a-very-long-name": "Backend"},
    )
    out = kvcore_cli("backends", "--json", site=site)
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["typo"]["imports"] is True and rows["typo"]["ok"] is False
    assert "kvcore_raed" in rows["typo"]["error"]
    assert rows["bare"]["ok"] is False and "implements no" in rows["bare"]["error"]
    assert rows["gone"]["imports"] is False and "not_installed_vendor_sdk" in rows["gone"]["error"]
    assert rows["a-backend-with-a-very-long-name"]["ok"] is True

    text = kvcore_cli("backends", site=site).stdout
    lines = text.splitlines()
    header = lines[0]
    # every row's columns start where the header's do, however long a name is
    status_col = header.index("STATUS")
    for name in ("typo", "bare", "gone", "a-backend-with-a-very-long-name", "file"):
        row = next(line for line in lines if line.startswith(name + " "))
        assert re.match(r"(ok|error)\b", row[status_col:]), (row, header)
    assert re.search(r"^typo: .*kvcore_raed", text, re.M)


@pytest.mark.skipif(
    importlib.util.find_spec("attentionstore_sdk") is not None,
    reason="the AttentionStore SDK is installed here: this test is about its absence",
)
def test_backends_open_reports_the_missing_sdk():
    out = kvcore_cli("backends", "--open", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["attentionstore"]["checked"] == "opened"
    assert rows["attentionstore"]["ok"] is False
    assert "AttentionStore SDK" in rows["attentionstore"]["error"]
    assert rows["memory"]["ok"] is True and rows["memory"]["checked"] == "opened"
