"""Config loading: types, unknown keys, env overrides, validation messages."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from mesh_runtime.config import ConfigError, ServerConfig, describe, load_config, setting, summary
from mesh_runtime.net import AddressError, format_host_port, parse_host_port

pytestmark = pytest.mark.timeout(30)


@dataclasses.dataclass
class Inner:
    ratio: float = setting(0.3, help="a ratio")

    def validate(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ConfigError("ratio", "must be in [0, 1]")


@dataclasses.dataclass
class Sample(ServerConfig):
    listen: str = setting("127.0.0.1:50059", help="where")
    mode: Literal["a", "b"] = setting("a", help="mode")
    peers: list[str] = setting(default_factory=list, help="peers")
    inner: Inner = setting(default_factory=Inner, help="nested")
    token: str = setting("", help="credential", secret=True)


def test_defaults_and_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mode: b\npeers: [x:1, y:2]\ninner:\n  ratio: 0.5\n")
    cfg = load_config(Sample, path)
    assert cfg.mode == "b" and cfg.peers == ["x:1", "y:2"] and cfg.inner.ratio == 0.5
    assert cfg.listen == "127.0.0.1:50059"


def test_env_and_flag_overrides_win_in_order(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("listen: 127.0.0.1:1\n")
    env = {"ROLLMESH_X__INNER__RATIO": "0.75", "ROLLMESH_X__LISTEN": "127.0.0.1:2", "OTHER": "1"}
    cfg = load_config(Sample, path, env=env, env_prefix="ROLLMESH_X", overrides={"listen": "127.0.0.1:3"})
    assert cfg.inner.ratio == 0.75
    assert cfg.listen == "127.0.0.1:3"


@pytest.mark.parametrize("overrides, key, fragment", [
    ({"mode": "c"}, "mode", "must be one of"),
    ({"peers": "x"}, "peers", "must be a list"),
    ({"inner.ratio": 2}, "inner.ratio", "must be in [0, 1]"),
    ({"inner.ratoi": 2}, "inner.ratoi", "did you mean 'inner.ratio'"),
    ({"listen": "nohost"}, "listen", "HOST:PORT"),
    ({"shutdown_grace_s": True}, "shutdown_grace_s", "must be a number"),
])
def test_bad_values_name_the_key(overrides, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(Sample, None, overrides=overrides)
    assert info.value.key == key
    assert fragment in str(info.value)


def test_unreadable_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(Sample, tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(Sample, bad)


def test_summary_redacts_secrets_and_describe_lists_every_key():
    cfg = load_config(Sample, None, overrides={"token": "s3cret"})
    assert summary(cfg)["token"] == "<redacted>"
    text = describe(Sample)
    for name in ("listen", "mode", "peers", "inner", "ratio", "token", "shutdown_grace_s"):
        assert f"{name}:" in text


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:0", ("127.0.0.1", 0)),
    ("[::1]:50051", ("::1", 50051)),
    ("localhost:8080", ("localhost", 8080)),
])
def test_parse_host_port(text, expected):
    assert parse_host_port(text) == expected
    assert parse_host_port(format_host_port(*expected)) == expected


@pytest.mark.parametrize("text", ["", ":80", "host", "host:x", "host:70000", "::1:80", "[zz]:1"])
def test_parse_host_port_rejects(text):
    with pytest.raises(AddressError):
        parse_host_port(text)


def test_relative_paths_in_a_config_file_are_relative_to_that_file(tmp_path, monkeypatch):
    """A config file's relative paths resolve against its own directory, whatever the working directory;
    flags and environment overrides stay relative to the working directory; a model preset stays a name."""
    from controller.config import ControllerConfig
    from launcher.job_config import JobConfig
    from replica_agent.config import ReplicaAgentConfig

    examples = Path(__file__).resolve().parents[2] / "examples"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    job = load_config(JobConfig, examples / "quickstart.yaml")
    assert job.data.train_files == [str(examples / "data" / "quickstart.parquet")]
    assert job.custom_reward_function.path == str(examples / "quickstart_reward.py")

    conf = tmp_path / "conf"
    (conf / "models" / "mine").mkdir(parents=True)
    (conf / "auto.yaml").write_text("{}\n")
    (conf / "ctl.yaml").write_text("state_dir: state\nautoscaler_config: auto.yaml\n")
    ctl = load_config(ControllerConfig, conf / "ctl.yaml")
    assert (ctl.state_dir, ctl.autoscaler_config) == (str(conf / "state"), str(conf / "auto.yaml"))
    flagged = load_config(ControllerConfig, conf / "ctl.yaml", overrides={"state_dir": "here"})
    assert flagged.state_dir == "here"   # a flag is relative to where the command runs
    (conf / "models" / "mine" / "config.json").write_text("{}")
    (conf / "agent.yaml").write_text("backend: synthetic\nmodel: models/mine\n")
    assert load_config(ReplicaAgentConfig, conf / "agent.yaml").model == str(conf / "models" / "mine")
    (conf / "agent.yaml").write_text("model: tiny-llama\n")
    assert load_config(ReplicaAgentConfig, conf / "agent.yaml").model == "tiny-llama"
