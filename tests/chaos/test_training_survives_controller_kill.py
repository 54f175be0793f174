"""A short fully-async training run (trainer + hybrid replica) survives a SIGKILL of the controller mid-step.

The quick start's mesh, started by hand from the configs ``rollmesh train``
would write, with the controller on a fixed port and a state directory: the
controller is SIGKILLed while the trainer is inside a step and started again
where it was. Its acknowledged state survives (durable before acknowledged),
the agents register again, the driver retries its step call on UNAVAILABLE and
gets the recorded answer, and training finishes every step with every sample
accounted for.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import yaml

from launcher.job_config import load_job_config, server_configs
from rollmesh.trainer.v1 import trainer_agent_pb2
from tests.chaos.training import outcome, steps as step_records
from tests.e2e.job_configs import job_config
from tests.processes import clean_env, free_port, running_server

pytestmark = pytest.mark.timeout(300)
STEPS = 8



async def test_training_finishes_through_a_controller_sigkill_mid_step(tmp_path):
    job = load_job_config(job_config(tmp_path, "quickstart.yaml", **{"trainer.total_training_steps": STEPS,
                                                                      "trainer.checkpoint": False}))
    env = clean_env(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    controller_address, trainer_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    with running_server("lb", ["--listen", "127.0.0.1:0"], env=env, log_path=tmp_path / "lb.log") as (lb, _):
        configs = server_configs(job, run_dir=tmp_path, lb=lb, controller=controller_address, trainer=trainer_address)
        configs["controller"].update(listen=controller_address, state_dir=str(tmp_path / "state"))
        for name, config in configs.items():
            (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        controller_args = ["--config", str(tmp_path / "controller.yaml")]
        with running_server("controller", controller_args, env=env, log_path=tmp_path / "c.log") as (_, ctl):
            agents = [running_server("trainer-agent" if name == "trainer-agent" else "replica-agent",
                                     ["--config", str(tmp_path / f"{name}.yaml")], env=env,
                                     log_path=tmp_path / f"{name}.log", ready_timeout_s=180)
                      for name in configs if name != "controller"]
            steps_file = tmp_path / "trainer" / "steps.jsonl"
            with agents[0], agents[1], agents[2]:
                deadline = time.monotonic() + 200
                while len(step_records(steps_file)) < 3:   # kill inside step 4: after step 3's record, before step 4's
                    assert time.monotonic() < deadline, "training never reached step 3"
                    await asyncio.sleep(0.01)
                ctl.send_signal(signal.SIGKILL)
                ctl.wait(timeout=10)
                with running_server("controller", controller_args, env=env, log_path=tmp_path / "c2.log"):
                    progress = await outcome(trainer_address, deadline + 60)
    assert progress.state == trainer_agent_pb2.TRAINING_STATE_FINISHED, progress.error_message
    steps = step_records(steps_file)
    assert [s["global_step"] for s in steps] == list(range(1, STEPS + 1))
    assert progress.samples_generated == progress.samples_consumed + progress.samples_dropped + progress.queue_size
