"""The adapter's settings: kvcore's base for every engine (backend, backend_config, namespace,
reopen_interval_s) with LMCache's own defaults and fields; a bad key is named, with where it
came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvcore_lmcache.plugin import plugin_settings
from kvcore_lmcache.settings import AdapterSettings

from kvcore.config import EngineBackendSettings

WHERE = "lmcache l2 adapter_params for kvcore"


def test_lmcaches_defaults_on_kvcores_base() -> None:
    settings = AdapterSettings.from_params(None, WHERE)
    assert isinstance(settings, EngineBackendSettings)
    assert (settings.backend, settings.namespace, settings.backend_config) == (
        "file",
        "lmcache",
        {},
    )
    assert (settings.reopen_interval_s, settings.io_threads) == (30.0, 4)


def test_backend_config_is_an_object_a_json_string_or_a_file(tmp_path: Path) -> None:
    inline = AdapterSettings.from_params({"backend_config": '{"root": "/x"}'}, WHERE)
    assert inline.backend_config == {"root": "/x"}
    path = tmp_path / "backend.json"
    path.write_text(json.dumps({"root": "/y"}))
    assert AdapterSettings.from_params({"backend_config": str(path)}, WHERE).backend_config == {
        "root": "/y"
    }


@pytest.mark.parametrize(
    ("params", "message"),
    [
        # one namespace rule for every backend: kv_file makes it a directory name
        ({"namespace": "team/a"}, f"{WHERE}: namespace: .*'team/a' must be 1-128 characters"),
        ({"namespace": "../../etc"}, f"{WHERE}: namespace: .*'../../etc' must be"),
        ({"backend_config": '{"root": '}, f"{WHERE}: backend_config: .*not valid JSON"),
        ({"reopen_interval_s": -1}, f"{WHERE}: reopen_interval_s: "),
        ({"backend": ""}, f"{WHERE}: backend: .*must name a kvcore backend"),
        ({"io_threads": 0}, f"{WHERE}: io_threads: "),
        # Python's bool is an int: `true` was taken as 1 thread
        ({"io_threads": True}, f"{WHERE}: io_threads: .*must be a number, not a boolean"),
        ({"chunk_tokens": False}, f"{WHERE}: chunk_tokens: .*not a boolean"),
    ],
)
def test_a_bad_setting_is_named(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdapterSettings.from_params(params, WHERE)


def test_the_storage_plugins_settings_name_their_prefix() -> None:
    extra = {
        "storage_plugin.kvcore.class_name": "KVCoreStoragePlugin",
        "storage_plugin.kvcore.namespace": "team/a",
    }
    with pytest.raises(ValueError, match=r"extra_config storage_plugin\.kvcore\.\*: namespace"):
        plugin_settings(extra, "KVCoreStoragePlugin")
