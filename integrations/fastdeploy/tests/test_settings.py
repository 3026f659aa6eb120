"""FastDeploy's environment becomes the kvcore backend's config, FastDeploy's defaults included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kv_file.config import FileConfig
from kv_mooncake.config import MooncakeConfig
from kvcore_fastdeploy import fastdeploy_backend_config, parse_backend_spec
from kvcore_fastdeploy.settings import FastDeploySettings

from kvcore.config import EngineBackendSettings


def test_file_root_is_fastdeploys_storage_dir() -> None:
    assert fastdeploy_backend_config("file", environ={}) == {"root": "/tmp/fastdeploy"}
    env = {"FILE_BACKEND_STORAGE_DIR": "/nvme/fd-cache"}
    config = fastdeploy_backend_config("file", environ=env)
    assert config == {"root": "/nvme/fd-cache"}
    assert FileConfig.load(config, environ={}).root == "/nvme/fd-cache"


def test_fastdeploys_mooncake_variables_set_the_fields() -> None:
    env = {
        "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.7",
        "MOONCAKE_METADATA_SERVER": "P2PHANDSHAKE",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(2 << 30),
        "MOONCAKE_LOCAL_BUFFER_SIZE": "67108864",
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_MASTER_SERVER_ADDR": "10.0.0.1:50051",
    }
    config = fastdeploy_backend_config("mooncake", environ=env)
    loaded = MooncakeConfig.load(config, environ={})  # kv_mooncake accepts every mapped field
    assert (loaded.local_hostname, loaded.metadata_server, loaded.protocol) == (
        "10.0.0.7",
        "P2PHANDSHAKE",
        "tcp",
    )
    assert (loaded.global_segment_size, loaded.local_buffer_size) == (2 << 30, 64 << 20)
    assert loaded.master_server_address == "10.0.0.1:50051"
    assert loaded.master_metrics_port is None, "FastDeploy never names the metrics port"


def test_fastdeploys_mooncake_defaults_apply() -> None:
    """mooncake_store.py: localhost, 1 GiB segment, 128 MiB buffer, rdma with found NICs."""
    config = fastdeploy_backend_config("mooncake", environ={"MOONCAKE_MASTER_SERVER_ADDR": "m:1"})
    assert config == {
        "master_metrics_port": None,
        "key_scheme": "as_is",  # FastDeploy's names are the keys: its data interoperates
        "local_hostname": "localhost",
        "global_segment_size": 1 << 30,
        "local_buffer_size": 128 << 20,
        "protocol": "rdma",
        "rdma_devices": "auto",
        "master_server_address": "m:1",
    }


@pytest.mark.parametrize(("rank", "device"), [(0, "mlx5_0"), (1, "mlx5_1"), (2, "mlx5_0")])
def test_each_rank_takes_its_nic_as_fastdeploy_does(rank: int, device: str) -> None:
    env = {"MOONCAKE_RDMA_DEVICES": "mlx5_0, mlx5_1", "MOONCAKE_MASTER_SERVER_ADDR": "m:1"}
    assert (
        fastdeploy_backend_config("mooncake", tp_rank=rank, environ=env)["rdma_devices"] == device
    )


def test_a_config_file_replaces_the_variables(tmp_path: Path) -> None:
    path = tmp_path / "mooncake_config.json"
    path.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp",
                "master_server_addr": "127.0.0.1:50051",
            }
        )
    )
    env = {"MOONCAKE_CONFIG_PATH": str(path), "MOONCAKE_MASTER_SERVER_ADDR": "ignored:1"}
    config = fastdeploy_backend_config("mooncake", environ=env)
    assert config["config_path"] == str(path)
    assert "master_server_address" not in config, "FastDeploy ignores the variables then"
    loaded = MooncakeConfig.load(config, environ={})
    assert (loaded.master_server_address, loaded.protocol) == ("127.0.0.1:50051", "tcp")
    assert loaded.global_segment_size == 1 << 30, "FastDeploy's default fills the gap"


def test_extra_config_variable_adds_fields(tmp_path: Path) -> None:
    env = {"KVCORE_FASTDEPLOY_BACKEND_CONFIG": '{"fsync": "data", "root": "/x"}'}
    assert fastdeploy_backend_config("file", environ=env) == {"fsync": "data", "root": "/x"}
    path = tmp_path / "extra.json"
    path.write_text('{"max_objects": 7}')
    env = {"KVCORE_FASTDEPLOY_BACKEND_CONFIG": str(path)}
    assert fastdeploy_backend_config("memory", environ=env) == {"max_objects": 7}
    with pytest.raises(ValueError, match="KVCORE_FASTDEPLOY_BACKEND_CONFIG"):
        fastdeploy_backend_config("memory", environ={"KVCORE_FASTDEPLOY_BACKEND_CONFIG": "{"})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("file", "kvcore:<name>"),
        ("kvcore:", "empty"),
        ("kvcore:attentionstore", "attention_store"),
    ],
)
def test_bad_backend_specs_are_named(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_backend_spec(spec)
    assert parse_backend_spec("kvcore:file") == "file"


def test_the_settings_gather_the_argument_the_model_id_and_the_environment() -> None:
    env = {
        "FILE_BACKEND_STORAGE_DIR": "/nvme/fd-cache",
        "KVCORE_FASTDEPLOY_REOPEN_INTERVAL_S": "2.5",
        "KVCORE_FASTDEPLOY_VERIFY_BLOCKS": "never",
    }
    settings = FastDeploySettings.from_environment(
        "kvcore:file", namespace="ERNIE-4.5-0.3B-Paddle", config={"fsync": "data"}, environ=env
    )
    assert isinstance(settings, EngineBackendSettings)
    assert (settings.backend, settings.namespace) == ("file", "ERNIE-4.5-0.3B-Paddle")
    assert settings.backend_config == {"root": "/nvme/fd-cache", "fsync": "data"}
    assert (settings.reopen_interval_s, settings.verify_blocks) == (2.5, "never")
    defaults = FastDeploySettings.from_environment("kvcore:memory", namespace="m", environ={})
    assert (defaults.reopen_interval_s, defaults.verify_blocks, defaults.backend_config) == (
        30.0,
        "auto",
        {},
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVCORE_FASTDEPLOY_REOPEN_INTERVAL_S": "soon"}, r"KVCORE_FASTDEPLOY_REOPEN_INTERVAL_S"),
        ({"KVCORE_FASTDEPLOY_REOPEN_INTERVAL_S": "-1"}, r"KVCORE_FASTDEPLOY_REOPEN_INTERVAL_S"),
        # beyond kvcore's longest wait (a week): the variable is named, not the field
        ({"KVCORE_FASTDEPLOY_REOPEN_INTERVAL_S": "1e9"}, r"KVCORE_FASTDEPLOY_REOPEN_INTERVAL_S: "),
        ({"KVCORE_FASTDEPLOY_VERIFY_BLOCKS": "sometimes"}, r"KVCORE_FASTDEPLOY_VERIFY_BLOCKS"),
        ({"KVCORE_FASTDEPLOY_BACKEND_CONFIG": "{"}, r"KVCORE_FASTDEPLOY_BACKEND_CONFIG"),
    ],
)
def test_a_bad_variable_is_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FastDeploySettings.from_environment("kvcore:memory", namespace="m", environ=env)


@pytest.mark.parametrize("model_id", ["team/a", "../../etc", ".hidden", ""])
def test_a_model_id_no_backend_takes_as_a_namespace_is_refused(model_id: str) -> None:
    with pytest.raises(ValueError, match=r"FastDeploy's model id \(the namespace\): .*namespace"):
        FastDeploySettings.from_environment("kvcore:memory", namespace=model_id, environ={})


def test_a_bad_backend_argument_is_named() -> None:
    with pytest.raises(ValueError, match="kvcore:<name>"):
        FastDeploySettings.from_environment("file", namespace="m", environ={})
