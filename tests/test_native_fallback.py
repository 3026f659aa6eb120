"""An install without the native extensions (built from the sdist with no compiler) runs the same
operations in Python: the swap ops' Python twin raises and moves exactly what the C++ extension
does, and kvcore with both extensions hidden serves kv_file and the CLI on the Python paths.
(tests/test_release.py builds such an install for real, from the sdist with no compiler.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvcore import _swap, _swap_py, native
from kvcore.host_memory import HostBuffer

#: Run before kvcore is imported: kvcore._swap and kvcore._fileio cannot be found, as in an
#: install built without a compiler (the .so files are simply not there).
HIDE_EXTENSIONS = """
import importlib.abc, sys
class _NoExtensions(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ("kvcore._swap", "kvcore._fileio"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoExtensions())
"""


def without_extensions(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    return subprocess.run(
        [sys.executable, "-c", HIDE_EXTENSIONS + code, *args],
        capture_output=True, text=True, env=env, timeout=timeout, check=False,
    )  # fmt: skip


def outcome(call: Callable[[], Any]) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def i64(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def u64(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


def test_the_python_twin_refuses_what_the_extension_refuses_with_the_same_words() -> None:
    host = HostBuffer(8 << 10, pinned=False)
    p = host.ptr
    nblocks = i64(4, 3)
    all_layers = [  # (dev_ptrs, host_ptrs, dev_nblocks, block_bytes, host_nblocks, dids, hids, mode)
        (u64(p, p), u64(p, p), nblocks, 64, 4, i64(0, 3), i64(0, 1), 0),  # 3 >= layer 1's 3
        (u64(p, p), u64(p, p), nblocks, 64, 4, i64(-1), i64(0), 1),
        (u64(p, p), u64(p, p), nblocks, 64, 4, i64(0, 1), i64(0, 4), 0),
        (u64(p, p), u64(p, p), nblocks, 64, 4, i64(0, 1), i64(2, 2), 0),  # duplicate destination
        (u64(p, p), u64(p, p), nblocks, 64, 4, i64(1, 1), i64(2, 3), 1),
        (u64(p, p), u64(p, p), nblocks, 64, 4, i64(1, 1), i64(2, 3), 0),  # duplicate source: ok
        (u64(p, p), u64(p, p), nblocks, 64, 4, i64(0), i64(0), 2),  # mode
        (u64(p, p), u64(p, p), nblocks, 0, 4, i64(0), i64(0), 0),  # block size
        (u64(p, p), u64(p, p), nblocks, 64, -1, i64(0), i64(0), 0),
        (u64(p, 0), u64(p, p), nblocks, 64, 4, i64(0), i64(0), 0),  # null layer pointer
        (u64(p), u64(p, p), nblocks, 64, 4, i64(0), i64(0), 0),  # lengths differ
        (u64(p, p), u64(p, p), nblocks, 64, 4, i64(0, 1), i64(0), 0),
        (u64(p, p), u64(p, p), nblocks, 64, 4, i64(), i64(), 2),  # nothing to move, bad mode
        (u64(p, p), u64(p, p), nblocks, 64, 4, np.zeros(1, np.int32), i64(0), 0),  # 4-byte ids
    ]
    for args in all_layers:
        native_says = outcome(lambda a=args: _swap.swap_all_layers(*a, 1))
        assert outcome(lambda a=args: _swap_py.swap_all_layers(*a, 1)) == native_says, args
    layout = [  # (layer_ptrs, layer_nblocks, block_bytes, staging, nslots, dids, sids, mode)
        (u64(p, p), nblocks, 64, p, 4, i64(0, 3), i64(0, 1), 0),
        (u64(p, p), nblocks, 64, p, 4, i64(0), i64(4), 0),
        (u64(p, p), nblocks, 64, p, -1, i64(0), i64(-2), 0),  # unknown slot count
        (u64(p, p), nblocks, 64, p, 4, i64(0, 1), i64(3, 3), 0),
        (u64(p, p), nblocks, 64, p, 4, i64(2, 2), i64(0, 1), 1),
        (u64(p, p), nblocks, 64, 0, 4, i64(0), i64(0), 0),  # null staging
        (u64(p, p), i64(4), 64, p, 4, i64(0), i64(0), 0),
        (u64(p, p), nblocks, 64, p, 4, i64(0), i64(0, 1), 1),
        (u64(p, p), nblocks, -8, p, 4, i64(0), i64(0), 1),
    ]
    for args in layout:
        native_says = outcome(lambda a=args: _swap.swap_layout(*a, 1))
        assert outcome(lambda a=args: _swap_py.swap_layout(*a, 1)) == native_says, args
    for requested, nbytes in [(0, 1 << 30), (0, 100), (3, 8192), (100, 1 << 30), (-1, 5 << 20)]:
        assert _swap_py.resolve_threads(requested, nbytes) == _swap.resolve_threads(
            requested, nbytes
        )


@pytest.mark.parametrize("seed", range(6))
def test_the_python_twin_moves_the_bytes_the_extension_moves(seed: int) -> None:
    """Random calls (runs, repeats, several layers, both directions, both layouts) on the same
    starting bytes leave the same bytes everywhere."""
    rng = np.random.default_rng(seed)
    nlayers, nblocks, block_bytes = int(rng.integers(1, 4)), 24, int(rng.choice([8, 40, 4096]))
    host_blocks, n, mode = 20, int(rng.integers(1, 16)), int(rng.integers(0, 2))
    start = rng.integers(0, 256, (nlayers, nblocks + host_blocks, block_bytes), dtype=np.uint8)
    dev_ids = rng.choice(nblocks, n, replace=False).astype(np.int64)
    if seed % 2:  # runs consecutive on both sides
        dev_ids = np.arange(3, 3 + n, dtype=np.int64)
    other_ids = rng.choice(host_blocks, n, replace=False).astype(np.int64)
    if seed % 3 == 0:
        other_ids = np.arange(n, dtype=np.int64)
    results = []
    for impl in (_swap, _swap_py):
        memory = start.copy()
        dev = [memory[layer, :nblocks] for layer in range(nlayers)]
        host = [memory[layer, nblocks:] for layer in range(nlayers)]
        staging = np.zeros((host_blocks, nlayers, block_bytes), dtype=np.uint8)
        staging[...] = start[0, nblocks:, :].reshape(host_blocks, 1, block_bytes)
        dev_ptrs = u64(*(d.ctypes.data for d in dev))
        impl.swap_all_layers(dev_ptrs, u64(*(h.ctypes.data for h in host)),
                             i64(*[nblocks] * nlayers), block_bytes, host_blocks, dev_ids,
                             other_ids, mode, 2)  # fmt: skip
        impl.swap_layout(dev_ptrs, i64(*[nblocks] * nlayers), block_bytes, staging.ctypes.data,
                         host_blocks, dev_ids, other_ids, 1 - mode, 2)  # fmt: skip
        results.append((memory, staging))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    assert not np.array_equal(results[0][0], start) or n == 0  # something moved


def test_an_extension_that_is_there_but_does_not_load_is_an_error(monkeypatch) -> None:
    """A missing dependency of the extension is not a build without a compiler: no fallback."""

    def broken(name: str) -> Any:
        raise ModuleNotFoundError("No module named 'libkvcore_dep'", name="libkvcore_dep")

    monkeypatch.setattr(native.importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="libkvcore_dep"):
        native.extension("_swap")

    def absent(name: str) -> Any:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(native.importlib, "import_module", absent)
    assert native.extension("_swap") is None


def test_this_build_has_both_extensions() -> None:
    assert native.swap_ops_native and native.file_ops is not None
    assert native.describe() == "native extensions: swap ops and file I/O in C++"


PROBE = """
import json
import numpy as np
from kvcore import fileio, native, ops
from kvcore.ops import HostBuffer, swap_cache_all_layers
layers = [np.arange(6 * 64, dtype=np.uint8).reshape(6, 64) + i for i in range(2)]
hosts = [HostBuffer(4 * 64, pinned=False) for _ in layers]
swap_cache_all_layers(layers, hosts, 4, [5, 1], [0, 3], 0, 0)
moved = all(
    np.array_equal(h.view(np.uint8, (4, 64))[[0, 3]], t[[5, 1]]) for t, h in zip(layers, hosts)
)
try:
    fileio.read_file("/nonexistent", bytearray(8), [])
    refused = ""
except fileio.NativeIOMissing as exc:
    refused = str(exc)
print(json.dumps({
    "swap_ops": ops._swap.__name__, "swap_native": native.swap_ops_native, "moved": moved,
    "fileio_available": fileio.AVAILABLE, "fileio_enabled": fileio.enabled(),
    "digests": fileio.NATIVE_DIGESTS, "kernel": fileio.DIGEST_KERNEL, "refused": refused,
    "native": native.describe(), "file_io": fileio.describe(),
}))
"""


def test_without_the_extensions_kvcore_runs_on_its_python_paths() -> None:
    done = without_extensions(PROBE)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["swap_ops"] == "kvcore._swap_py" and got["swap_native"] is False
    assert got["moved"] is True
    assert got["fileio_available"] is False and got["fileio_enabled"] is False
    assert got["digests"] is False and got["kernel"] == "none"
    assert "built without its native file I/O" in got["refused"]
    assert got["native"].startswith("native extensions: absent (swap ops and file I/O in Python")
    assert got["file_io"] == "file I/O: Python (kvcore was built without its native extension)"


CLI = "import sys\nfrom kvcore.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def test_without_the_extensions_the_cli_says_so_and_kv_file_passes_the_kit(tmp_path) -> None:
    listing = without_extensions(CLI, "backends")
    assert listing.returncode == 0, listing.stderr[-3000:]
    assert "native extensions: absent" in listing.stdout, listing.stdout
    assert "file I/O: Python (kvcore was built without" in listing.stdout, listing.stdout

    config = json.dumps({"root": str(tmp_path / "store")})
    kit = without_extensions(CLI, "check", "file", "--config", config)
    assert kit.returncode == 0, kit.stdout[-3000:] + kit.stderr[-3000:]
    assert "0 failed" in kit.stdout, kit.stdout[-2000:]

    demo_config = json.dumps({"root": str(tmp_path / "demo-store")})
    demo = without_extensions(CLI, "demo", "--config", demo_config, "--conversations", "1",
                              "--turns", "2")  # fmt: skip
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "OK: every restored byte matched" in demo.stdout


def test_the_file_codes_spelled_out_in_python_are_the_extensions() -> None:
    """kvcore.fileio spells the extension's codes out (so they exist without it): they must not
    drift from csrc/file_ops.h."""
    from kvcore import _fileio, fileio

    for member in fileio.FileRead:
        assert getattr(_fileio, member.name) == member.value, member
    assert (_fileio.BATCH_READ, _fileio.BATCH_WRITE) == (fileio._BATCH_READ, fileio._BATCH_WRITE)
