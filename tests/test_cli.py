"""Each CLI command in a subprocess on a temporary root; numbers parsed, not just exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from fake_dist import make_dist

from kvcore import fileio

ROOT = Path(__file__).resolve().parents[1]


def kvcore_cli(
    *args: str, site: Path | None = None, timeout: int = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    environ = dict(os.environ)
    environ.pop("KVCORE_DEBUG", None)
    # the CLI's per-run logs go to a scratch directory, not the user's state directory
    environ.setdefault("KVCORE_LOG_DIR", os.path.join(tempfile.gettempdir(), "kvcore-test-logs"))
    if site is not None:
        environ["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT / "tests")])
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvcore", *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=timeout,
    )


def test_backends_json_lists_the_three_backends():
    out = kvcore_cli("backends", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    for name, dist in [
        ("file", "kvcore-file"),
        ("mooncake", "kvcore-mooncake"),
        ("attentionstore", "kvcore-attentionstore"),
        ("memory", "kvcore"),
    ]:
        assert rows[name]["distribution"] == dist
        assert rows[name]["imports"] is True, rows[name]["error"]
        assert rows[name]["ok"] is True, rows[name]["error"]
        assert rows[name]["checked"] == "import, class, hooks (not opened)"
        assert rows[name]["capabilities"]["io"] in ("host", "device")
    text = kvcore_cli("backends")
    assert re.search(
        r"^file\s+kvcore-file\s+\S+\s+ok\s+import, class, hooks \(not opened\)\s+key-addressed",
        text.stdout,
        re.M,
    ), text.stdout
    assert "Not opened" in text.stdout  # says plainly what was not checked
    # which native extensions this install has (all of them, in a build with a compiler)
    assert "native extensions: swap ops and file I/O in C++" in text.stdout, text.stdout
    # which file I/O path kv_file takes: native (the default), or Python when chosen
    assert re.search(r"^file I/O: native", text.stdout, re.M), text.stdout
    if fileio.NATIVE_DIGESTS:  # and which xxh3 kernel this CPU runs
        assert f"{fileio.DIGEST_KERNEL} kernel" in text.stdout, text.stdout
    python_io = kvcore_cli("backends", env={"KVCORE_NATIVE_IO": "0"})
    assert "file I/O: Python (KVCORE_NATIVE_IO=0)" in python_io.stdout, python_io.stdout


def _table(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^  (\S[\w /]+?)\s{2,}(.+)$", stdout, re.M))


def test_demo_verifies_bytes_and_a_kept_namespace_hits_on_a_second_run(tmp_path):
    cfg = json.dumps({"root": str(tmp_path / "store")})
    small = ("--conversations", "3", "--turns", "3")
    first = kvcore_cli("demo", "--config", cfg, *small, "--namespace", "ns-1", "--keep")
    assert first.returncode == 0, first.stderr
    t = _table(first.stdout)
    assert t["turns"] == "9"
    assert t["byte mismatches"] == "0" and t["errors"] == "0"
    hit = float(t["storage hit rate"].split()[0])
    assert 0 < hit < 100  # shared system prompt and growing turns hit; new text misses
    assert int(t["blocks read"]) > 0 and int(t["blocks written"].split()[0]) > 0
    assert t["namespace"] == "ns-1"
    assert t["data"] == f"kept in {tmp_path / 'store' / 'ns-1'}"  # where the objects really are
    assert any((tmp_path / "store" / "ns-1").iterdir())
    assert "9/9 turns" in first.stderr  # progress, one line per tenth off a terminal
    second = kvcore_cli("demo", "--json", "--config", cfg, *small, "--namespace", "ns-1", "--keep")
    s = json.loads(second.stdout)
    assert s["hit_rate"] == 1.0 and s["blocks_written"] == 0 and s["mismatches"] == 0
    assert s["blocks_read"] == s["prompt_blocks"] > 0
    # a run without --namespace starts from nothing: it never sees another run's data
    third = kvcore_cli("demo", "--json", "--config", cfg, *small, "--keep")
    t3 = json.loads(third.stdout)
    assert t3["namespace"].startswith("kvcore-demo-") and t3["hit_rate"] < 1.0


LYING_BACKEND = """
import ctypes
import kvcore
from memory_backend import MemoryBackend

class Backend(MemoryBackend):
    @kvcore.hookimpl
    def kvcore_read(self, request):
        n = MemoryBackend.kvcore_read(self, request)
        for i in range(n):
            ptr, _ = request.host.segments(i, 0)[0]
            ctypes.memset(ptr, 7, 16)   # corrupt what it returns
        return n
"""


def test_a_lying_backend_is_caught_by_the_block_digests(tmp_path):
    """The memory backend keeps no checksum, so the manager keeps a digest beside each block:
    the corrupt bytes are refused (and removed) before the engine sees them."""
    site = tmp_path / "site"
    make_dist(site, "lying-kv", "lying_kv", LYING_BACKEND, {"lying": "Backend"})
    out = kvcore_cli(
        "demo", "--backend", "lying", "--conversations", "2", "--turns", "2", site=site
    )
    assert out.returncode == 9, out.stdout + out.stderr
    table = _table(out.stdout)
    assert int(table["byte mismatches"]) == 0 and int(table["errors"]) > 0
    assert "differs from its digest" in out.stdout


def test_demo_fails_on_a_byte_mismatch(tmp_path):
    """Without the digests, the demo's own check of every restored byte catches the lie."""
    site = tmp_path / "site"
    make_dist(site, "lying-kv", "lying_kv", LYING_BACKEND, {"lying": "Backend"})
    out = kvcore_cli(
        "demo", "--backend", "lying", "--conversations", "2", "--turns", "2", site=site,
        env={"KVCORE_TRANSFER_VERIFY_BLOCKS": "never"},
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert int(_table(out.stdout)["byte mismatches"]) > 0
    assert "FAILED" in out.stdout


FAILING_BACKEND = """
import kvcore
from memory_backend import MemoryBackend

class Backend(MemoryBackend):
    @kvcore.hookimpl
    def kvcore_write(self, request):
        raise RuntimeError("disk on fire")
"""


def test_demo_exits_9_when_the_backend_fails_during_the_run(tmp_path):
    site = tmp_path / "site"
    make_dist(site, "failing-kv", "failing_kv", FAILING_BACKEND, {"failing": "Backend"})
    out = kvcore_cli(
        "demo", "--backend", "failing", "--conversations", "1", "--turns", "2", site=site
    )
    assert out.returncode == 9, out.stdout + out.stderr
    assert int(_table(out.stdout)["errors"]) > 0
    assert "disk on fire" in out.stdout  # an error sample in the summary


def test_bench_reports_figures_and_ratios(tmp_path):
    cfg = json.dumps({"root": str(tmp_path / "store")})
    out = kvcore_cli("bench", "--json", "--blocks", "2", "--repeats", "1", "--config", cfg)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    f = data["figures"]
    assert f["bytes_per_op"] == 2 * 2 * 28 * 8 * 64 * 128 * 2
    assert f["write_gbps"] > 0 and f["read_gbps"] > 0 and f["memcpy_gbps"] > 0
    assert data["verified"] is True
    assert data["ratios"]["read_vs_memcpy"] > 0
    assert data["namespace"].startswith("kvcore-bench-")
    assert "3/3 steps" in out.stderr  # progress: buffers, one repetition, one raw baseline
    human = kvcore_cli("bench", "--blocks", "1", "--repeats", "1", "--config", cfg)
    assert re.search(r"read\s+\d+\.\d+ GB/s", human.stdout), human.stdout


def test_check_passes_file_and_summarises(tmp_path):
    cfg = json.dumps({"root": str(tmp_path / "store")})
    out = kvcore_cli("check", "file", "--config", cfg, "-k", "round_trip or gap or hostile")
    assert out.returncode == 0, out.stdout[-3000:]
    m = re.search(
        r"kvcore check file: (\d+) passed, (\d+) failed, (\d+) errors, (\d+) skipped", out.stdout
    )
    assert m and int(m.group(1)) >= 10 and m.group(2) == "0" and m.group(3) == "0"


BROKEN = """
import kvcore
from memory_backend import MemoryBackend

class Backend(MemoryBackend):
    @kvcore.hookimpl
    def kvcore_query(self, request):
        return request.num_blocks     # claims everything is there
"""


def test_check_fails_a_broken_backend(tmp_path):
    site = tmp_path / "site"
    make_dist(site, "broken-kv", "broken_kv", BROKEN, {"broken": "Backend"})
    out = kvcore_cli("check", "broken", site=site)
    assert out.returncode == 1
    m = re.search(r"kvcore check broken: (\d+) passed, (\d+) failed", out.stdout)
    assert m and int(m.group(2)) > 0
    assert "FAILED TestInstalledBackend::test_gap_ends_the_run" in out.stdout


@pytest.mark.parametrize(
    "bad", ['{"root": ', '["not", "an", "object"]', "/no/such/file.json", '{"rooot": 1}']
)
def test_bad_config_argument_is_one_line_with_the_config_exit_code(bad):
    out = kvcore_cli("demo", "--config", bad)
    assert out.returncode == 3, out.stderr
    assert out.stderr.startswith("kvcore: error: ")
    assert len(out.stderr.strip().splitlines()) <= 2  # the error, and maybe where the log is
    assert "--config" in out.stderr or "rooot" in out.stderr


CLOSE_FAILS = """
import kvcore
from memory_backend import MemoryBackend

class Backend(MemoryBackend):
    @kvcore.hookimpl
    def kvcore_close(self):
        raise RuntimeError("close fails")
"""


def test_check_counts_errors_apart_from_failures(tmp_path):
    site = tmp_path / "site"
    make_dist(site, "closeboom-kv", "closeboom_kv", CLOSE_FAILS, {"closeboom": "Backend"})
    out = kvcore_cli("check", "closeboom", "-k", "round_trip_is_byte_exact", site=site)
    assert out.returncode == 1, out.stdout[-3000:]
    m = re.search(r"closeboom: (\d+) passed, (\d+) failed, (\d+) errors", out.stdout)
    assert m and m.group(2) == "0" and int(m.group(3)) == int(m.group(1)) > 0  # every teardown
    assert "  ERROR TestInstalledBackend::test_round_trip_is_byte_exact[float16] (teardown)" in (
        out.stdout
    )


def test_version_lists_the_core_and_every_installed_plugin(capsys) -> None:
    import kvcore
    from kvcore.cli import main as cli_main

    with pytest.raises(SystemExit) as done:
        cli_main(["--version"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["kvcore", kvcore.__version__]
    names = {line.split()[0] for line in lines}
    assert "kvcore-file" in names  # the README's install includes it
