"""Configuration, defaults, hostile names and file permissions."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import pytest
from kv_file import FileConfig
from kv_file_testutil import object_files, open_store, read_verified, write

import kvcore
from kvcore import ConfigError

HOSTILE = ["../../../../etc/passwd", "/abs/path", "a\x00b", "x" * 10_000, "..", "名前/\n", "\udc80"]


def test_hostile_names_stay_inside_the_root(tmp_path) -> None:
    root = tmp_path / "s"
    store = open_store(str(root))
    keys = [f"{h}{i}" for i, h in enumerate(HOSTILE)]
    assert write(store, keys) == len(keys)
    assert read_verified(store, keys) == len(keys)
    store.close()
    outside = [p for p in tmp_path.rglob("*") if root not in p.parents and p != root]
    assert outside == []
    for path in object_files(str(root)):
        name = os.path.basename(path)
        assert len(name) == 35 and all(c in "0123456789abcdef" for c in name[:32]), name


def test_permissions_are_private(tmp_path) -> None:
    old = os.umask(0)  # even a permissive umask must not widen them
    try:
        store = open_store(str(tmp_path / "s"))
        assert write(store, ["p"]) == 1
        store.close()
    finally:
        os.umask(old)
    ns = tmp_path / "s" / "default"
    assert stat.S_IMODE(ns.stat().st_mode) == 0o700
    for d in ns.iterdir():  # the fan-out directories, the journal and its ledger
        assert stat.S_IMODE(d.stat().st_mode) == (0o700 if d.is_dir() else 0o600), d
    assert (ns / "journal").is_file() and (ns / "ledger").is_file()
    files = object_files(str(ns))
    assert files
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


def test_default_config_needs_no_settings(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for k in list(os.environ):
        if k.startswith("KVCORE_FILE_"):
            monkeypatch.delenv(k)
    backend = kvcore.open_backend("file", context={"rank": 1, "world_size": 2})
    assert backend.plugin._dir.path == str(tmp_path / "xdg" / "kvcore" / "default")
    backend.close()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert FileConfig.load().root == str(tmp_path / "home" / ".cache" / "kvcore")


def test_environment_overrides(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVCORE_FILE_ROOT", str(tmp_path / "env"))
    monkeypatch.setenv("KVCORE_FILE_CAPACITY_BYTES", "2GiB")
    monkeypatch.setenv("KVCORE_FILE_FSYNC", "data")
    monkeypatch.setenv("KVCORE_FILE_NAMESPACE", "model-a")
    cfg = FileConfig.load({"root": "/ignored"})
    assert (cfg.root, cfg.capacity_bytes, cfg.fsync) == (str(tmp_path / "env"), 2 * 2**30, "data")
    assert cfg.namespace == "model-a"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(4096, 4096), ("4096", 4096), ("500MB", 500 * 10**6), ("64GiB", 64 * 2**30), ("2k", 2000)],
)
def test_sizes_are_kvcore_byte_sizes(raw: object, expected: int) -> None:
    # one convention for every plugin: GB = 10**9, GiB = 2**30
    assert FileConfig.load({"capacity_bytes": raw}).capacity_bytes == expected


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("namespace", "../up"),
        ("namespace", "a/b"),
        ("namespace", ".hidden"),
        ("capacity_bytes", 0),
        ("capacity_bytes", "lots"),
        ("capacity_bytes", -5),
        ("fsync", "sometimes"),
        ("io_threads", 0),
        ("low_watermark", 1.5),
        ("root", ""),
        ("default_timeout_s", float("inf")),
        ("default_timeout_s", 1e10),
        ("rescan_interval_s", float("inf")),
        ("rescan_interval_s", 1e10),
    ],
)
def test_bad_settings_name_the_field(tmp_path, field: str, value: object) -> None:
    cfg = {"root": str(tmp_path), field: value}
    with pytest.raises(ConfigError, match=field):
        kvcore.open_backend("file", cfg)


def _root_cases(tmp_path) -> dict[str, tuple[str, str]]:
    regular = tmp_path / "a-file"
    regular.write_text("x")
    return {
        "a regular file": (str(regular), "is a regular file, not a directory"),
        "under a regular file": (str(regular / "store"), "lies under .* which is a regular file"),
        "under a device": ("/dev/null/store", "lies under '/dev/null', which is not a directory"),
        "in /proc": ("/proc/kvcore-store", "does not let directories be created"),
    }


@pytest.mark.parametrize(
    "case", ["a regular file", "under a regular file", "under a device", "in /proc"]
)
def test_a_root_that_cannot_hold_a_store_is_one_line_naming_root(tmp_path, case: str) -> None:
    root, why = _root_cases(tmp_path)[case]
    with pytest.raises(ConfigError) as info:
        kvcore.open_backend("file", {"root": root})
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid config for backend 'file':" and len(lines) == 2, lines
    assert lines[1].startswith("  root: ") and root in lines[1]
    assert re.search(why, lines[1]), lines[1]
    # the CLI prints it as one line
    out = subprocess.run(
        [sys.executable, "-m", "kvcore", "demo", "--config", json.dumps({"root": root})],
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in out.stderr.splitlines() if line.startswith("kvcore: error:")]
    assert len(errors) == 1 and "root:" in errors[0] and re.search(why, errors[0]), out.stderr


def test_watermarks_must_be_ordered(tmp_path) -> None:
    with pytest.raises(ConfigError, match="low_watermark"):
        kvcore.open_backend(
            "file", {"root": str(tmp_path), "low_watermark": 0.9, "high_watermark": 0.5}
        )


def test_hostile_context_namespace_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="context namespace"):
        kvcore.open_backend("file", {"root": str(tmp_path)}, context={"namespace": "../x"})


def test_namespaces_do_not_see_each_other(tmp_path) -> None:
    a = open_store(str(tmp_path), namespace="a")
    b = open_store(str(tmp_path), namespace="b")
    assert write(a, ["k"]) == 1
    assert b.query(b.request("q", ["k"])) == 0
    a.close()
    b.close()


def test_flush_token_index_is_a_no_op(tmp_path) -> None:
    store = open_store(str(tmp_path))
    assert write(store, ["k"]) == 1
    assert store.flush_token_index(store.request("f", ["k"]), True) == 0
    assert store.query(store.request("q", ["k"])) == 1
    store.close()
