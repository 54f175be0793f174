"""The controller's reference-named flags set their config keys, over the file and the environment."""

from __future__ import annotations

import pytest

from launcher.cli import build_parser, server_config
from mesh_runtime.config import ConfigError


def _config(argv, env=None, tmp_path=None):
    return server_config("controller", build_parser().parse_args(["controller", *argv]), env or {})


def test_flags_set_their_keys_and_win_over_file_and_environment(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("scale_in_drain_timeout: 12\nscale_out_timeout: 100\n")
    auto = tmp_path / "auto.yaml"
    auto.write_text("enabled: true\n")
    cfg = _config(["--config", str(conf), "--scale-in-drain-timeout", "5", "--scale-in-shutdown-timeout", "7.5",
                   "--scale-out-partial-success-policy", "keep_partial", "--autoscaler-config", str(auto),
                   "--store", "etcd://127.0.0.1:2379,127.0.0.1:2381/mesh"],
                  env={"ROLLMESH_CONTROLLER__SCALE_IN_DRAIN_TIMEOUT": "9"})
    assert cfg.scale_in_drain_timeout == 5.0
    assert cfg.scale_in_shutdown_timeout == 7.5
    assert cfg.scale_out_timeout == 100.0  # from the file: no flag given
    assert cfg.scale_out_partial_success_policy == "keep_partial"
    assert cfg.autoscaler_config == str(auto)
    assert cfg.store == "etcd://127.0.0.1:2379,127.0.0.1:2381/mesh"


def test_defaults_are_the_references():
    cfg = _config([])
    assert (cfg.scale_out_timeout, cfg.scale_in_drain_timeout, cfg.scale_in_shutdown_timeout) == (1800.0, 30.0, 20.0)
    assert cfg.scale_out_partial_success_policy == "rollback_all"
    assert cfg.autoscaler_config == "" and cfg.store == ""   # SQLite in state_dir


@pytest.mark.parametrize("argv, key", [
    (["--scale-in-drain-timeout", "soon"], "scale_in_drain_timeout"),
    (["--scale-out-partial-success-policy", "maybe"], "scale_out_partial_success_policy"),
    (["--autoscaler-config", "/nonexistent/auto.yaml"], "autoscaler_config"),
    (["--store", "redis://127.0.0.1:6379/x"], "store"),
])
def test_bad_flag_values_name_the_key(argv, key):
    with pytest.raises(ConfigError) as err:
        _config(argv)
    assert key in str(err.value)
