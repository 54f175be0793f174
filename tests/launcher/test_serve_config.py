"""``rollmesh up --config``'s server configs: with ``weights_dir``, a trainer agent serving the versions a trainer
outside rollmesh publishes, and the overrides that point verl's plugin at the mesh (examples/verl)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.local_mesh import VERL_BLOCK, verl_overrides
from launcher.serve_config import load_serve_config, serve_server_configs
from mesh_runtime.config import ConfigError


def _load(tmp_path: Path, text: str):
    (tmp_path / "serve.yaml").write_text(text)
    return load_serve_config(tmp_path / "serve.yaml")


def test_without_weights_dir_there_is_no_trainer_agent(tmp_path):
    for text in ("model: tiny-llama\nreplicas: 2\n", "verl: true\n"):   # verl's rank 0 serves its own weights
        configs = serve_server_configs(_load(tmp_path, text), "127.0.0.1:8000")
        assert sorted(configs) == ["controller", "lb", "replica-agent"]


def test_weights_dir_adds_a_trainer_agent_reading_it_relative_to_the_file(tmp_path):
    serve = _load(tmp_path, "model: tiny-llama\nseed: 3\nweights_dir: w\n")
    trainer = serve_server_configs(serve, "127.0.0.1:8000")["trainer-agent"]
    assert trainer == {"model": "tiny-llama", "model_seed": 3,
                       "weight_source": "trainer_agent.published_weights:DirectoryWeightSource",
                       "weight_source_options": {"directory": str((tmp_path / "w").resolve())}}


def test_a_bad_weights_dir_type_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="weights_dir"):
        _load(tmp_path, "weights_dir: [1, 2]\n")


def test_verl_overrides_name_the_controller_the_directory_and_a_trainer_agent_identity(tmp_path):
    overrides = verl_overrides(tmp_path / "run", "127.0.0.1:4000", str(tmp_path / "w"))
    values = dict(o.removeprefix(f"+{VERL_BLOCK}.").split("=", 1) for o in overrides)
    assert values["controller"] == "127.0.0.1:4000" and values["weights_dir"] == str((tmp_path / "w").resolve())
    assert Path(values["tls.cert"]).name == "trainer-agent-verl.pem" and Path(values["tls.key"]).is_file()
    assert Path(values["tls.ca"]) == (tmp_path / "run" / "pki" / "ca.pem").resolve()
    assert all(o.startswith(f"+{VERL_BLOCK}.") for o in overrides)


def test_without_weights_dir_verls_overrides_name_no_directory(tmp_path):
    values = dict(o.removeprefix(f"+{VERL_BLOCK}.").split("=", 1)
                  for o in verl_overrides(tmp_path / "run", "127.0.0.1:4000"))
    assert sorted(values) == ["controller", "tls.ca", "tls.cert", "tls.key"]
