"""Builds csrc/swap_ops_cuda.cu with nvcc (skipped without nvcc) and runs it where a GPU is.

On a machine with the toolkit but no driver, loading works and the first CUDA call reports
"CUDA driver version is insufficient" (error 35); host-side id validation still works there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).parent / "cuda" / "run_cuda_ops.py"


def load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_cuda_ops", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


runner = load_runner()
if runner.find_nvcc() is None:
    pytest.skip("nvcc not found", allow_module_level=True)


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory):
    return runner.Lib(runner.build(tmp_path_factory.mktemp("cuda")))


@pytest.fixture(scope="module")
def device_count(lib) -> int:
    try:
        return lib.device_count()
    except RuntimeError as exc:
        assert "CUDA driver version is insufficient" in str(exc) or "no CUDA-capable" in str(exc)
        return 0


def test_library_exports(lib) -> None:
    for name in (
        "kvc_cuda_swap_all_layers",
        "kvc_cuda_swap_layout",
        "kvc_cuda_host_alloc",
        "kvc_cuda_host_free",
        "kvc_swap_layout",
    ):
        assert hasattr(lib.lib, name)


def test_ids_validated_before_any_cuda_call(lib) -> None:
    # Validation runs on the host first, so it reports bad ids even without a device.
    with pytest.raises(ValueError, match=r"device_block_ids\[1\]=4 out of range \[0, 4\)"):
        lib.layout([4096], [4], 1024, 4096, 2, [0, 4], [0, 1], 0)
    with pytest.raises(ValueError, match="host_block_ids contains duplicate destination id 1"):
        lib.all_layers([4096], [8192], [4], 1024, 2, [0, 2], [1, 1], 0)
    lib.layout([4096], [4], 1024, 4096, 2, [], [], 0)  # nothing to do: no CUDA call either


def test_driverless_machine_reports_error_35(lib, device_count: int) -> None:
    if device_count > 0:
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match=r"error 35|error 100"):
        lib.pinned(4096)


def test_ops_loads_cuda_library_via_env(lib, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcore import cuda_lib, ops

    monkeypatch.setenv("KVCORE_CUDA_LIB", lib.lib._name)
    monkeypatch.setattr(cuda_lib, "_cuda_state", {})
    loaded = cuda_lib.load_cuda_lib()
    assert loaded is not None and loaded.path == lib.lib._name
    assert ops.cuda_available() == _has_device(lib)
    monkeypatch.setattr(cuda_lib, "_cuda_state", {})  # back to the default lookup for later tests


def _has_device(lib) -> bool:
    try:
        return lib.device_count() > 0
    except RuntimeError:
        return False


def test_round_trips_on_device(lib, device_count: int) -> None:
    if device_count == 0:
        pytest.skip("no CUDA device")
    for block_bytes in (128 << 10, 2048, 1000):
        runner.check_round_trips(lib, block_bytes)
