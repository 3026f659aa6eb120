"""EnvConfig through pydantic-settings: the operator's environment overrides, and its errors
name the variable (what ``kvcore`` prints, and what an engine's log shows)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from pydantic import BaseModel, ByteSize, Field, ValidationError, model_validator

from kvcore.errors import ConfigError
from kvcore.schemas import BackendConfig


class _Inner(BaseModel):
    depth: int = 1


class _Cfg(BackendConfig):
    env_prefix = "KVCORE_ENVTEST_"
    # a name accepted at top level that a validator moves into a nested model (as
    # TransferConfig takes "rank" and moves it into its context)
    env_extra_fields: ClassVar[tuple[str, ...]] = ("depth",)

    root: str = "/default"
    capacity_bytes: ByteSize = ByteSize(10)
    ratio: float = Field(default=0.5, gt=0, le=1)
    tags: list[str] = []
    devices: str | list[str] = "auto"
    inner: _Inner = _Inner()
    limit: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _depth_at_top_level(cls, data: Any) -> Any:
        if isinstance(data, dict) and "depth" in data:
            data = dict(data)
            data["inner"] = {**dict(data.get("inner") or {}), "depth": data.pop("depth")}
        return data


def test_values_are_read_the_way_pydantic_settings_reads_them():
    env = {
        "KVCORE_ENVTEST_ROOT": "/from-env",
        "KVCORE_ENVTEST_CAPACITY_BYTES": "2GiB",  # ByteSize's units
        "KVCORE_ENVTEST_TAGS": '["a", "b"]',  # lists are JSON
        "KVCORE_ENVTEST_DEVICES": "mlx5_0",  # a union with str: a plain string stays one
        "KVCORE_ENVTEST_INNER": "{}",  # models are JSON
        "kvcore_envtest_ratio": "0.25",  # names match case-insensitively
        "KVCORE_ENVTEST_DEPTH": "3",  # an extra name, moved by the validator
    }
    cfg = _Cfg.load({"root": "/from-file", "capacity_bytes": 5}, environ=env)
    assert cfg.root == "/from-env"  # the environment beats the given config
    assert cfg.capacity_bytes == 2 * 2**30
    assert cfg.tags == ["a", "b"] and cfg.devices == "mlx5_0" and cfg.inner.depth == 3
    assert cfg.ratio == 0.25
    assert _Cfg.load({}, environ={"KVCORE_ENVTEST_DEVICES": '["a", "b"]'}).devices == ["a", "b"]
    assert _Cfg.load({}, environ={}).root == "/default"


@pytest.mark.parametrize(
    ("variable", "value", "field", "words"),
    [
        ("KVCORE_ENVTEST_CAPACITY_BYTES", "lots", "capacity_bytes", "could not parse"),
        ("KVCORE_ENVTEST_RATIO", "2", "ratio", "less than or equal to 1"),
        ("KVCORE_ENVTEST_TAGS", "[not json", "tags", "Invalid JSON"),
        ("KVCORE_ENVTEST_INNER", '{"depth": "deep"}', "inner", "integer"),
        ("KVCORE_ENVTEST_DEPTH", "first", "depth", "integer"),
    ],
)
def test_an_invalid_value_names_its_variable(variable, value, field, words):
    with pytest.raises(ValidationError) as info:
        _Cfg.load({}, environ={variable: value})
    text = str(info.value)
    assert variable in text and field in text and words in text, text
    # and the one-line form every kvcore error path uses
    err = ConfigError.from_validation("config", info.value)
    assert f"(environment variable {variable})" in str(err)


def test_an_invalid_value_given_in_the_config_names_no_variable():
    with pytest.raises(ValidationError) as info:
        _Cfg.load({"ratio": 2}, environ={"KVCORE_ENVTEST_ROOT": "/x"})
    assert "environment variable" not in str(info.value)


def test_backend_configs_that_read_more_variables_still_work():
    from kv_mooncake.config import MooncakeConfig

    env = {"MOONCAKE_MASTER": "10.0.0.1:50051", "KVCORE_MOONCAKE_REPLICA_NUM": "2"}
    cfg = MooncakeConfig.load({}, environ=env)
    assert cfg.master_server_address == "10.0.0.1:50051" and cfg.replica_num == 2
    with pytest.raises(ValidationError, match="KVCORE_MOONCAKE_REPLICA_NUM"):
        MooncakeConfig.load({}, environ={**env, "KVCORE_MOONCAKE_REPLICA_NUM": "0"})
