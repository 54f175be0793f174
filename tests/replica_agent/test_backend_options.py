"""What a replica agent's config hands to each engine backend: every out-of-process backend gets its model
directory as ``model_path`` and the replica's memory fraction."""

from __future__ import annotations

import json

import pytest

from mesh_runtime.config import ConfigError
from replica_agent.config import ReplicaAgentConfig
from replica_agent.engines import create_engine
from replica_agent.engines.sglang_engine import SglangEngine
from replica_agent.engines.vllm_engine import VllmEngine


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8}))
    return tmp_path


@pytest.mark.parametrize("backend, engine_class", [("vllm", VllmEngine), ("sglang", SglangEngine)])
def test_an_agent_config_builds_its_backend(model_dir, backend, engine_class):
    config = ReplicaAgentConfig(backend=backend, model=str(model_dir), node_id="n1", gpu_memory_utilization=0.4,
                                engine_options={"url": "http://127.0.0.1:30000"} if backend == "sglang" else {})
    config.validate()
    engine = create_engine(backend, **config.engine_options_for("HYBRID", "r1", 3))
    assert isinstance(engine, engine_class)
    assert engine.config.model_path == str(model_dir) and engine.config.memory_fraction == 0.4
    assert (engine.config.replica_id, engine.config.node_id, engine.config.weight_version) == ("r1", "n1", 3)


def test_bad_sglang_options_fail_the_config_at_load_time(model_dir):
    with pytest.raises(ConfigError, match="url must look like"):
        ReplicaAgentConfig(backend="sglang", model=str(model_dir), engine_options={"url": "nope"}).validate()
    with pytest.raises(ConfigError, match="config.json"):
        ReplicaAgentConfig(backend="sglang", model=str(model_dir / "missing")).validate()
    with pytest.raises(ConfigError):
        ReplicaAgentConfig(backend="tensorrt", model=str(model_dir)).validate()
