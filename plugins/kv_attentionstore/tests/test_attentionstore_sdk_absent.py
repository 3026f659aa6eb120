"""Without the SDK the plugin still imports and is listed; only opening it fails, clearly."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kv_attentionstore import SdkMissingError

import kvcore
from kvcore.testing import small_layout

REFERENCE_SDK = str(Path(__file__).parent / "reference_sdk")

# Runs in a fresh interpreter whose path lacks the reference SDK (conftest is not loaded).
SCRIPT = """
import ctypes, json, sys
import kvcore

out = {"listed": "attentionstore" in [b.name for b in kvcore.available_backends()]}
import kv_attentionstore
out["sdk_imported_by_plugin"] = "attentionstore_sdk" in sys.modules
try:
    kvcore.open_backend("attentionstore", context={"layout": LAYOUT})
    out["open"] = "opened"
except ImportError as exc:
    out["open"] = f"{type(exc).__name__}: {exc}"


class Neighbour:
    config_model = kvcore.BackendConfig
    capabilities = kvcore.Capabilities()

    def __init__(self, config, context):
        self.objects = {}

    @kvcore.hookimpl
    def kvcore_query(self, request):
        return kvcore.leading_run([n in self.objects for ns in request.object_names for n in ns], 2)

    @kvcore.hookimpl
    def kvcore_read(self, request):
        return 0

    @kvcore.hookimpl
    def kvcore_write(self, request):
        for names in request.object_names:
            for name in names:
                self.objects[name] = b"x"
        return request.num_blocks


with kvcore.open_backend(Neighbour, strict=True) as other:
    buf = ctypes.create_string_buffer(8)
    host = kvcore.HostBuffers(ptrs=((ctypes.addressof(buf), ctypes.addressof(buf)),), nbytes=(8, 8))
    other.write(other.request("t", ["k0"], host=host))
    out["neighbour_query"] = other.query(other.request("t", ["k0"]))
print(json.dumps(out))
"""


@pytest.fixture
def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AS_")}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != REFERENCE_SDK]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def test_without_the_sdk_only_opening_this_backend_fails(clean_env: dict[str, str]) -> None:
    probe = subprocess.run(
        [sys.executable, "-c", "import attentionstore_sdk"], env=clean_env, capture_output=True
    )
    if probe.returncode == 0:
        pytest.skip("an attentionstore_sdk is installed in this environment")
    layout = small_layout().model_dump(mode="json")
    script = SCRIPT.replace("LAYOUT", repr(layout))
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=clean_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["listed"] is True
    assert out["sdk_imported_by_plugin"] is False
    assert out["open"].startswith("SdkMissingError: ")
    assert "pip install" in out["open"] and "attentionstore_sdk" in out["open"]
    assert out["neighbour_query"] == 1


def test_missing_sdk_message_in_process(monkeypatch: pytest.MonkeyPatch, fast_config: dict) -> None:
    for name in ("attentionstore_sdk", "attentionstore_sdk.sdk", "attentionstore_sdk.utils.err"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules blocks the import
    with pytest.raises(SdkMissingError, match="not published on PyPI"):
        kvcore.open_backend("attentionstore", fast_config, context={"layout": small_layout()})


def test_reference_sdk_is_what_the_tests_use() -> None:
    spec = importlib.util.find_spec("attentionstore_sdk")
    assert spec is not None and spec.origin is not None
    assert spec.origin.startswith(REFERENCE_SDK), "tests must run on the labelled stand-in"
