"""Config loading: fields, sizes, FastDeploy's JSON file and variables, precedence, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kv_mooncake import MooncakeBackend, MooncakeConfig

import kvcore
from kvcore.registry import validate_config

MASTER = {"master_server_address": "10.0.0.5:50051"}


def load(config: dict | None = None, **environ: str) -> MooncakeConfig:
    return MooncakeConfig.load(config, environ=environ)


def test_defaults_are_single_host_tcp() -> None:
    cfg = load(MASTER)
    assert cfg.metadata_server == "P2PHANDSHAKE"
    assert cfg.protocol == "tcp"
    assert cfg.local_hostname == "127.0.0.1"
    assert cfg.health_url() == "http://10.0.0.5:9003/health"
    assert (cfg.master_host, cfg.master_port) == ("10.0.0.5", 50051)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (1024, 1024),
        ("1024", 1024),
        ("16MB", 16 * 10**6),  # decimal, as everywhere in kvcore: GB = 10**9
        ("16MiB", 16 << 20),
        ("4 GiB", 4 << 30),
        ("1.5k", 1500),
    ],
)
def test_sizes_are_kvcore_byte_sizes(raw: int | str, expected: int) -> None:
    for field in ("global_segment_size", "max_batch_bytes"):
        assert getattr(load({**MASTER, field: raw}), field) == expected


@pytest.mark.parametrize(("raw", "expected"), [(0, 0), ("16MiB", 16 << 20), ("1GB", 10**9)])
def test_local_buffer_is_none_or_at_least_what_mooncake_takes(raw: object, expected: int) -> None:
    assert load({**MASTER, "local_buffer_size": raw}).local_buffer_size == expected


@pytest.mark.parametrize("raw", ["16MB", 1, "1MiB"])
def test_a_local_buffer_mooncake_refuses_is_named(raw: object) -> None:
    with pytest.raises(kvcore.ConfigError, match="local_buffer_size"):
        validate_config("mooncake", MooncakeBackend, {**MASTER, "local_buffer_size": raw})


def test_missing_master_is_named() -> None:
    with pytest.raises(kvcore.ConfigError, match="master_server_address"):
        validate_config("mooncake", MooncakeBackend, {})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("master_server_address", "no-port"),
        ("master_server_address", "host:99999"),
        ("protocol", "udp"),
        ("global_segment_size", "lots"),
        ("global_segment_size", -1),
        ("rdma_devices", []),
        ("master_metrics_port", 0),
    ],
)
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(kvcore.ConfigError, match=field):
        validate_config("mooncake", MooncakeBackend, {**MASTER, field: value})


def test_fastdeploy_variables(tmp_path: Path) -> None:
    cfg = load(
        None,
        MOONCAKE_MASTER="10.1.1.1:7000",
        MOONCAKE_PROTOCOL="RDMA",
        MOONCAKE_DEVICE="mlx5_0,mlx5_1",
        MOONCAKE_TE_META_DATA_SERVER="P2PHANDSHAKE",
        LOCAL_HOSTNAME="10.1.1.2",
        MOONCAKE_GLOBAL_SEGMENT_SIZE="8GB",
        MOONCAKE_LOCAL_BUFFER_SIZE="134217728",
    )
    assert cfg.master_server_address == "10.1.1.1:7000"
    assert cfg.protocol == "rdma"
    assert cfg.devices_for(0) == "mlx5_0,mlx5_1"
    assert cfg.local_hostname == "10.1.1.2"
    assert cfg.global_segment_size == 8 * 10**9  # decimal since kvcore.ByteSize
    assert cfg.local_buffer_size == 128 << 20


def test_fastdeploy_json_file_and_precedence(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {
                "local_hostname": "10.2.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "rdma",
                "device_name": "mlx5_2,mlx5_3",
                "master_server_address": "10.2.0.9:50051",
                "global_segment_size": 1 << 30,
            }
        )
    )
    from_file = load({"master_server_address": "1.1.1.1:1"}, MOONCAKE_CONFIG_PATH=str(path))
    assert from_file.master_server_address == "10.2.0.9:50051"  # environment beats the config
    assert from_file.devices_for(0) == "mlx5_2,mlx5_3"
    assert from_file.global_segment_size == 1 << 30
    # a MOONCAKE_* variable beats the file; a KVCORE_MOONCAKE_* variable beats both
    both = load(
        None,
        MOONCAKE_CONFIG_PATH=str(path),
        MOONCAKE_MASTER="10.3.0.1:1",
        KVCORE_MOONCAKE_MASTER_SERVER_ADDRESS="10.4.0.1:2",
        MOONCAKE_PROTOCOL="tcp",
    )
    assert both.master_server_address == "10.4.0.1:2"
    assert both.protocol == "tcp"
    assert both.devices_for(0) == ""  # NICs only matter for rdma
    # config_path given in the config works like the variable
    assert load({"config_path": str(path)}).local_hostname == "10.2.0.1"


def test_unreadable_json_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(kvcore.ConfigError, match="MOONCAKE_CONFIG_PATH"):
        load(None, MOONCAKE_CONFIG_PATH=str(bad))
    with pytest.raises(kvcore.ConfigError, match="cannot read"):
        load(None, MOONCAKE_CONFIG_PATH=str(tmp_path / "missing.json"))


def test_unknown_key_in_json_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({**MASTER, "protocoll": "tcp"}))
    with pytest.raises(kvcore.ConfigError, match="protocoll"):
        validate_config("mooncake", MooncakeBackend, {"config_path": str(path)})


def test_rdma_devices_per_local_device() -> None:
    cfg = load({**MASTER, "protocol": "rdma", "rdma_devices": ["mlx5_0", "mlx5_1", "auto"]})
    assert [cfg.devices_for(d) for d in range(4)] == ["mlx5_0", "mlx5_1", "", "mlx5_0"]
    assert cfg.device_entry(2) == "auto"
    listed = load(None, MOONCAKE_MASTER="h:1", KVCORE_MOONCAKE_RDMA_DEVICES='["a", "b"]')
    assert listed.rdma_devices == ["a", "b"]


def test_no_health_check_when_metrics_port_is_none() -> None:
    assert load({**MASTER, "master_metrics_port": None}).health_url() is None
