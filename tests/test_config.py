"""EngineBackendSettings: what every engine adapter's settings share (the backend by name, its
config, the namespace, the reopen interval), validated one way; check_namespace: the one rule
a namespace follows."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import Field, ValidationError

from kvcore.config import (
    MAX_NAMESPACE_CHARS,
    EngineBackendSettings,
    check_namespace,
    interval_field,
)


class _Adapter(EngineBackendSettings):
    """An adapter's settings: its own defaults and an extra field."""

    backend: str = Field(default="file")
    namespace: str = Field(default="engine")
    io_threads: int = Field(default=4, ge=1)


class _Derived(EngineBackendSettings):
    """An adapter whose namespace, when not given, is derived later."""

    namespace: str | None = Field(default=None)  # type: ignore[assignment]


def _error(model: type[EngineBackendSettings], **fields: Any) -> tuple[tuple[Any, ...], str]:
    with pytest.raises(ValidationError) as info:
        model(**fields)
    (err,) = info.value.errors()
    return err["loc"], str(info.value)


def test_the_fields_and_their_defaults() -> None:
    s = EngineBackendSettings(backend="memory")
    assert (s.backend, s.backend_config, s.namespace, s.reopen_interval_s) == (
        "memory",
        {},
        "default",
        30.0,
    )
    assert _error(EngineBackendSettings)[0] == ("backend",)  # the base requires a backend
    a = _Adapter()
    assert (a.backend, a.namespace, a.io_threads) == ("file", "engine", 4)


def test_backend_config_is_an_object_or_json_or_a_json_file(tmp_path) -> None:
    assert EngineBackendSettings(backend="m", backend_config={"a": 1}).backend_config == {"a": 1}
    inline = EngineBackendSettings(backend="m", backend_config='{"root": "/x"}')
    assert inline.backend_config == {"root": "/x"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"max_objects": 7}))
    assert EngineBackendSettings(backend="m", backend_config=str(path)).backend_config == {
        "max_objects": 7
    }
    assert EngineBackendSettings(backend="m", backend_config=None).backend_config == {}
    assert EngineBackendSettings(backend="m", backend_config="").backend_config == {}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"root": ', "not valid JSON"),
        ("/no/such/file.json", "neither a JSON object nor a file"),
        (["a"], "valid dictionary"),
    ],
)
def test_a_bad_backend_config_names_the_field(value: Any, message: str) -> None:
    loc, text = _error(_Adapter, backend_config=value)
    assert loc == ("backend_config",)
    assert "backend_config" in text and message in text


@pytest.mark.parametrize(
    "namespace", ["team/a", "../../etc", "..", ".hidden", "-rf", "", "a b", "a\n", "x" * 129]
)
@pytest.mark.parametrize("model", [EngineBackendSettings, _Adapter, _Derived])
def test_a_namespace_no_backend_takes_is_refused_naming_the_field(
    model: type[EngineBackendSettings], namespace: str
) -> None:
    loc, text = _error(model, backend="file", namespace=namespace)
    assert loc == ("namespace",)
    assert f"namespace {namespace!r} must be 1-128 characters from [A-Za-z0-9._-]" in text


@pytest.mark.parametrize(
    "namespace", ["default", "a", "_x", "lmcache", "ERNIE-4.5-0.3B", "x" * 128]
)
def test_a_namespace_every_backend_takes_is_kept(namespace: str) -> None:
    assert EngineBackendSettings(backend="file", namespace=namespace).namespace == namespace
    assert check_namespace(namespace) == namespace
    assert len(namespace) <= MAX_NAMESPACE_CHARS


def test_an_optional_namespace_may_be_left_to_derive() -> None:
    assert _Derived(backend="file").namespace is None
    assert _Derived(backend="file", namespace=None).namespace is None
    assert _Derived(backend="file", namespace="given").namespace == "given"


@pytest.mark.parametrize("value", [-1, float("inf"), float("nan"), 10**9, True])
def test_a_bad_reopen_interval_names_the_field(value: Any) -> None:
    loc, text = _error(_Adapter, reopen_interval_s=value)
    assert loc == ("reopen_interval_s",) and "reopen_interval_s" in text


def test_a_subclass_may_restate_the_interval_and_keeps_its_bounds() -> None:
    class Quick(EngineBackendSettings):
        reopen_interval_s: float = interval_field(5.0, "tried again sooner")

    assert Quick(backend="m").reopen_interval_s == 5.0
    assert _error(Quick, backend="m", reopen_interval_s=-1)[0] == ("reopen_interval_s",)
    assert Quick(backend="m", reopen_interval_s=0).reopen_interval_s == 0


@pytest.mark.parametrize("backend", ["", "  "])
def test_an_empty_backend_name_is_refused(backend: str) -> None:
    loc, text = _error(_Adapter, backend=backend)
    assert loc == ("backend",) and "must name a kvcore backend" in text


def test_unknown_fields_are_refused_and_settings_are_frozen() -> None:
    assert _error(_Adapter, backend_confg={})[0] == ("backend_confg",)
    s = _Adapter()
    with pytest.raises(ValidationError, match="frozen"):
        s.namespace = "other"  # type: ignore[misc]


def test_check_namespace_names_the_field_it_is_given() -> None:
    with pytest.raises(ValueError, match=r"^context namespace 'a/b' must be"):
        check_namespace("a/b", "context namespace")
