"""What the job's rollout dtype and delta setting become in the servers' configs (launcher.job_config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.job_config import load_job_config, server_configs
from mesh_runtime.config import ConfigError, build_config
from replica_agent.config import ReplicaAgentConfig
from trainer_agent.config import TrainerAgentConfig

ROOT = Path(__file__).resolve().parents[2]


def configs(tmp_path: Path, **overrides) -> dict[str, dict]:
    job = load_job_config(ROOT / "examples" / "quickstart.yaml", overrides=overrides)
    job.validate()
    return server_configs(job, run_dir=tmp_path, lb="127.0.0.1:1", controller="127.0.0.1:2", trainer="127.0.0.1:3")


def test_a_bf16_rollout_is_served_in_bf16_by_every_replica_and_broadcast_in_it(tmp_path):
    out = configs(tmp_path, **{"actor_rollout_ref.rollout.dtype": "bfloat16", "mesh.weight_delta_max_ratio": 0.2})
    agents = [name for name in out if name.startswith(("rollout-", "trainer-0-replicas"))]
    assert agents and all(out[name]["engine_options"]["dtype"] == "bfloat16" for name in agents)
    trainer = out["trainer-agent"]
    assert trainer["served_dtype"] == "bfloat16" and trainer["weight_transfer"]["delta_max_ratio"] == 0.2
    build_config(TrainerAgentConfig, trainer).validate()   # the trainer agent takes what the launcher writes
    build_config(ReplicaAgentConfig, out[agents[0]]).validate()


def test_auto_leaves_the_engines_and_the_trainer_their_own_dtype(tmp_path):
    out = configs(tmp_path)
    assert "dtype" not in out["rollout-0"]["engine_options"] and out["trainer-agent"]["served_dtype"] == ""
    assert out["trainer-agent"]["weight_transfer"]["delta_max_ratio"] == 0.5


@pytest.mark.parametrize(("overrides", "key"), [
    ({"actor_rollout_ref.rollout.dtype": "int8"}, "dtype"),
    ({"mesh.weight_delta_max_ratio": 1.5}, "weight_delta_max_ratio"),
])
def test_bad_values_name_their_key(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=key):
        configs(tmp_path, **overrides)
