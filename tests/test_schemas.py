"""Schemas: derived sizes, validation errors that name the field, environment overrides."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import kvcore
from kvcore import BackendConfig, CacheLayout, ReadTask, SwapTask


def test_layout_sizes():
    lay = CacheLayout(num_layers=28, num_heads=8, block_size=64, head_dim=128)
    assert lay.kv_layer_block_bytes == 8 * 64 * 128 * 2
    assert lay.part_bytes("k") == 28 * 128 * 1024
    assert lay.block_bytes == 2 * 28 * 128 * 1024
    assert lay.parts == ("k", "v")
    fp8 = CacheLayout(
        num_layers=2,
        num_extra_layers=1,
        num_heads=4,
        block_size=16,
        head_dim=64,
        dtype="block_wise_fp8",
        num_blocks=10,
        extra_num_blocks=6,
    )
    assert fp8.parts == ("k", "v", "k_scale", "v_scale")
    assert fp8.part_bytes("k") == 3 * 4 * 16 * 64
    assert fp8.part_bytes("v_scale") == 3 * 4 * 16 * 4
    assert [fp8.layer_num_blocks(i) for i in range(3)] == [10, 10, 6]


def test_unknown_and_bad_fields_are_named():
    with pytest.raises(ValidationError, match="num_layer"):
        CacheLayout(num_layer=2, num_heads=1, block_size=1, head_dim=1)
    with pytest.raises(ValidationError, match="dtype"):
        CacheLayout(num_layers=2, num_heads=1, block_size=1, head_dim=1, dtype="float64")
    with pytest.raises(ValidationError, match="device_block_ids"):
        ReadTask(task_id="t", keys=["a", "b"], device_block_ids=[1])
    with pytest.raises(ValidationError, match="host_block_ids"):
        SwapTask(task_id="t", direction="to_host", device_block_ids=[1], host_block_ids=[])
    with pytest.raises(ValidationError, match="rank"):
        kvcore.BackendContext(rank=2, world_size=2)


class _Cfg(BackendConfig):
    env_prefix = "KVCORE_TESTCFG_"
    root: str = "/default"
    capacity_bytes: int = 10
    tags: list[str] = []


def test_environment_overrides_config_and_parses_json():
    env = {
        "KVCORE_TESTCFG_ROOT": "/from-env",
        "KVCORE_TESTCFG_CAPACITY_BYTES": "42",
        "KVCORE_TESTCFG_TAGS": '["a", "b"]',
    }
    cfg = _Cfg.load({"root": "/from-file", "capacity_bytes": 5}, environ=env)
    assert (cfg.root, cfg.capacity_bytes, cfg.tags) == ("/from-env", 42, ["a", "b"])
    with pytest.raises(ValidationError, match="capacity_bytes"):
        _Cfg.load({}, environ={"KVCORE_TESTCFG_CAPACITY_BYTES": "lots"})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"capacity_bytes": True}, "capacity_bytes: must be a number, not a boolean"),
        ({"admission_doorkeeper": True}, "admission_doorkeeper: must be a number, not a boolean"),
        ({"admission_doorkeeper": 1e-300}, "admission_doorkeeper: Input should be greater"),
        ({"admission_sample_rate": 5e-324}, "admission_sample_rate: 5e-324 is a subnormal"),
        ({"high_watermark": False}, "high_watermark: must be a number, not a boolean"),
    ],
)
def test_config_numbers_are_numbers(tmp_path, config, message) -> None:
    """Python's bool is an int and 5e-324 a float: both were accepted as sizes and rates (a
    1-byte store, a doorkeeper of one id). Every backend config refuses them, naming the field."""
    with pytest.raises(kvcore.ConfigError, match=message):
        kvcore.check_backend_config("file", {"root": str(tmp_path), **config})
    # booleans stay booleans where a field takes one
    kvcore.check_backend_config("file", {"root": str(tmp_path), "direct_reads": True})
