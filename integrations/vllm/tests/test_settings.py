"""The connector's and the tier's settings: kvcore's base for every engine (backend, required
here, backend_config, namespace, reopen_interval_s) with vLLM's fields; a bad key is named under
where vLLM took it from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvcore_vllm.config import (
    ConnectorSettings,
    SettingsError,
    TierSettings,
    load_settings,
    load_tier_settings,
)

from kvcore.config import EngineBackendSettings


def test_both_settings_are_kvcores_base_with_vllms_defaults() -> None:
    for settings in (load_settings({"backend": "memory"}), load_tier_settings({"backend": "file"})):
        assert isinstance(settings, EngineBackendSettings)
        assert (settings.namespace, settings.backend_config, settings.reopen_interval_s) == (
            "default",
            {},
            30.0,
        )
        assert settings.weight_version == ""
    assert isinstance(ConnectorSettings(backend="memory"), EngineBackendSettings)
    assert isinstance(TierSettings(backend="memory"), EngineBackendSettings)


def test_backend_config_is_an_object_a_json_string_or_a_file(tmp_path: Path) -> None:
    inline = load_settings({"backend": "file", "backend_config": '{"root": "/x"}'})
    assert inline.backend_config == {"root": "/x"}
    path = tmp_path / "backend.json"
    path.write_text(json.dumps({"root": "/y"}))
    assert load_tier_settings({"backend": "file", "backend_config": str(path)}).backend_config == {
        "root": "/y"
    }


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, r"\.backend: Field required"),
        ({"backend": ""}, r"\.backend: .*must name a kvcore backend"),
        ({"backend": "file", "namespace": "team/a"}, r"\.namespace: .*'team/a' must be 1-128"),
        ({"backend": "file", "namespace": "../../etc"}, r"\.namespace: .*'../../etc' must be"),
        ({"backend": "file", "backend_config": "{"}, r"\.backend_config: .*not valid JSON"),
        ({"backend": "file", "reopen_interval_s": -1}, r"\.reopen_interval_s: "),
    ],
)
def test_a_bad_key_is_named(settings: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=r"kv_connector_extra_config" + message):
        load_settings(settings)
    with pytest.raises(SettingsError, match=r"secondary_tiers\[type=kvcore\]" + message):
        load_tier_settings(settings)
