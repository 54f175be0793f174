"""``rollmesh train`` with a verl user's config: verl's whole async_training block and a verl-shaped policy
class loaded by import path from a checkout on PYTHONPATH, Ray not installed, across the real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import verl_shaped
from tests.e2e.job_configs import job_config
from tests.processes import clean_env

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def test_a_verl_config_and_policy_train_unchanged(tmp_path):
    checkout = verl_shaped.write_verl_package(tmp_path / "verl-checkout")
    block = {**verl_shaped.VERL_ASYNC_TRAINING, **verl_shaped.VERL_ASYNC_TRAINING_EXTRA,
             "use_dynamic_resource_scheduling": True, "dynamic_schedule_policy": verl_shaped.FIXED,
             "dynamic_schedule_deactivate_ratio": 0.6, "staleness_threshold": 0.5,
             "trigger_parameter_sync_step": 1}
    config = job_config(tmp_path, "quickstart.yaml", **{"trainer.total_training_steps": STEPS,
                                                        "async_training": block})
    env = clean_env(GLOO_SOCKET_IFNAME="lo",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")])))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "train", "--config", str(config),
                           "--run-dir", str(run_dir)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=360)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    # one line at start names what verl's block holds that rollmesh does not act on
    assert "rollmesh train: async_training: accepted, no effect in rollmesh: " in out
    assert "use_trainer_do_validate" in out and "checkpoint_engine" in out
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["scheduler"]["policy_name"] == verl_shaped.FIXED
    transitions = metrics["summary"]["transitions"]
    assert transitions["activations"] >= 1 and transitions["deactivations"] >= 1
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    rebalances = [e for e in events if e["type"] == "STEP_PHASE" and e.get("attributes", {}).get("phase")
                  == "rebalance"]
    assert rebalances and all(e["attributes"]["requested"] == "rollouter" for e in rebalances)
    steps = [json.loads(line) for line in (run_dir / "trainer" / "steps.jsonl").read_text().splitlines()]
    assert len([s for s in steps if s["event"] == "step"]) == STEPS
