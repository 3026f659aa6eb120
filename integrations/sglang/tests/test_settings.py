"""The adapter's keys of the extra config: kvcore's base for every engine (backend,
backend_config, namespace, reopen_interval_s) with SGLang's defaults and fields; a namespace the
operator gives follows kvcore's one rule, and one not given is derived from the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvcore_sglang import EXTRA_CONFIG
from kvcore_sglang.settings import StorageIdentity, StorageSettings, safe_namespace
from kvcore_sglang.testing import storage_config

from kvcore.config import EngineBackendSettings, check_namespace


def settings(**extra: object) -> StorageSettings:
    return StorageSettings.from_extra_config({**EXTRA_CONFIG, **extra})


def test_sglangs_defaults_on_kvcores_base() -> None:
    s = settings()
    assert isinstance(s, EngineBackendSettings)
    assert (s.backend, s.namespace, s.backend_config, s.reopen_interval_s) == (
        "file",
        None,
        {},
        30.0,
    )
    assert settings(namespace=None).namespace is None  # derived from the model later


def test_backend_config_is_an_object_a_json_string_or_a_file(tmp_path: Path) -> None:
    assert settings(backend_config={"root": "/x"}).backend_config == {"root": "/x"}
    assert settings(backend_config='{"root": "/x"}').backend_config == {"root": "/x"}
    path = tmp_path / "backend.json"
    path.write_text(json.dumps({"root": "/y"}))
    assert settings(backend_config=str(path)).backend_config == {"root": "/y"}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"namespace": "team/a"}, r"namespace: .*'team/a' must be 1-128 characters"),
        ({"namespace": "../../etc"}, r"namespace: .*'../../etc' must be"),
        ({"namespace": ""}, r"namespace: .*'' must be"),
        ({"namespace": "  "}, r"namespace: .*'  ' must be"),
        ({"backend_config": "{"}, r"backend_config: .*not valid JSON"),
        ({"reopen_interval_s": -1}, r"reopen_interval_s: "),
        ({"backend": ""}, r"backend: .*must name a kvcore backend"),
    ],
)
def test_a_bad_key_is_named(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"hicache storage extra config for kvcore: {message}"):
        settings(**extra)


def test_a_given_namespace_leads_the_derived_one_which_follows_the_rule_too() -> None:
    identity = StorageIdentity.from_storage_config(storage_config(), settings(namespace="team-a"))
    assert identity.namespace.startswith("team-a.")
    assert check_namespace(identity.namespace) == identity.namespace
    for text in ("meta-llama/Llama-3.1-8B", "../../etc", "m" * 300, "-x"):
        assert check_namespace(safe_namespace(text))
