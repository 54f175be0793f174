"""A fully-async training run on a mesh with no single point of failure survives a kill -9 of any one server.

The quick start's mesh, started by hand from the configs ``rollmesh train``
would write, with two controllers (``first`` leads, ``second`` stands by) on
one real etcd, two load balancers that register with the controllers, and
every caller of the controller (the replica agent, the balancers, the trainer
agent's driver, which reads the balancers from the controller) given both
controller addresses. The leader is SIGKILLed (a) inside a training step,
between its BeginTrainingStep and its CompleteTrainingStep, or (b) during a
weight sync: the standby takes the store over within the lease and the callers
move to it by themselves. Or (c) one balancer is SIGKILLed inside a step: the
rollouter's requests caught on it are retried with the same id on the other
one, the controller drops it when its lease lapses, and the driver's ring
follows. No process is restarted, and training finishes every step with every
sample accounted for.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import grpc
import pytest
import yaml

from launcher.job_config import load_job_config, server_configs
from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc, events_pb2, observability_pb2, registry_pb2
from rollmesh.trainer.v1 import trainer_agent_pb2
from tests.chaos.training import outcome, steps as step_records
from tests.e2e.job_configs import job_config
from tests.etcd_server import etcd_cluster, needs_etcd
from tests.processes import clean_env, free_port, running_server
from tests.waiting import wait_until

pytestmark = [needs_etcd, pytest.mark.timeout(300)]
STEPS = 8


async def _wait_for_sync_start(address: str, timeout_s: float) -> None:
    """Return as soon as the controller at ``address`` starts a weight sync after the first steps."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        call = stub.WatchEvents(observability_pb2.WatchEventsRequest(
            types=[events_pb2.EVENT_TYPE_WEIGHT_SYNC_STARTED]), timeout=timeout_s)
        seen = 0
        async for _ in call:
            seen += 1
            if seen >= 2:   # not the first sync: the run is well under way
                call.cancel()
                return


@pytest.mark.parametrize("moment", ["mid-step", "weight-sync", "balancer"])
async def test_training_finishes_through_a_kill_of_the_leader_or_of_a_balancer(tmp_path, moment):
    job = load_job_config(job_config(tmp_path, "quickstart.yaml", **{"trainer.total_training_steps": STEPS,
                                                                      "trainer.checkpoint": False}))
    env = clean_env(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    first, second = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    trainer_address = f"127.0.0.1:{free_port()}"
    controllers = f"{first},{second}"
    for name in ("lb-1", "lb-2"):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"controller_address": controllers,
                                                               "balancer_id": name}))
    lb_args = {name: ["--config", str(tmp_path / f"{name}.yaml"), "--listen", "127.0.0.1:0"]
               for name in ("lb-1", "lb-2")}
    with etcd_cluster(tmp_path / "etcd") as etcd, \
            running_server("lb", lb_args["lb-1"], env=env, log_path=tmp_path / "lb-1.log") as (_, lb1), \
            running_server("lb", lb_args["lb-2"], env=env, log_path=tmp_path / "lb-2.log"):
        # no balancer address anywhere: the balancers register, the driver reads them from the controller
        configs = server_configs(job, run_dir=tmp_path, lb="", controller=controllers, trainer=trainer_address)
        for name, listen in (("first", first), ("second", second)):
            config = {**configs["controller"], "listen": listen, "node_id": name, "store": etcd.url("/job"),
                      "store_lease_ttl_s": 2, "standby_refresh_s": 0.5, "lease_ttl_s": 4}
            (tmp_path / f"controller-{name}.yaml").write_text(yaml.safe_dump(config))
        del configs["controller"]
        for name, config in configs.items():
            (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        leader_args = ["--config", str(tmp_path / "controller-first.yaml")]
        standby_args = ["--config", str(tmp_path / "controller-second.yaml")]
        with running_server("controller", leader_args, env=env, log_path=tmp_path / "first.log") as (_, leader), \
                running_server("controller", standby_args, env=env, log_path=tmp_path / "second.log"):
            agents = [running_server("trainer-agent" if name == "trainer-agent" else "replica-agent",
                                     ["--config", str(tmp_path / f"{name}.yaml")], env=env,
                                     log_path=tmp_path / f"{name}.log", ready_timeout_s=180)
                      for name in configs]
            steps_file = tmp_path / "trainer" / "steps.jsonl"
            with contextlib.ExitStack() as running:
                procs = [running.enter_context(agent)[1] for agent in agents]
                deadline = time.monotonic() + 200
                if moment in ("mid-step", "balancer"):   # after step 3's record, before step 4's: inside step 4
                    while len(step_records(steps_file)) < 3:
                        assert time.monotonic() < deadline, "training never reached step 3"
                        await asyncio.sleep(0.01)
                else:
                    await _wait_for_sync_start(first, 200)
                killed_at_step = len(step_records(steps_file))
                victim = lb1 if moment == "balancer" else leader
                victim.send_signal(signal.SIGKILL)
                victim.wait(timeout=10)
                progress = await outcome(trainer_address, deadline + 60)
                alive = [p.poll() is None for p in procs]   # no agent exited: they moved to the new leader
                survivor = first if moment == "balancer" else second
                async with grpc.aio.insecure_channel(survivor) as channel:
                    stub = controller_pb2_grpc.ControllerServiceStub(channel)
                    status = await stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=10)
                    held = ["lb-2"] if moment == "balancer" else ["lb-1", "lb-2"]

                    async def leases_held() -> bool:
                        listed = await stub.ListBalancers(registry_pb2.ListBalancersRequest(), timeout=10)
                        return [b.balancer_id for b in listed.balancers if b.lease_held] == held

                    # training may finish before a killed balancer's 4 s lease lapses: wait for the lapse itself
                    await wait_until(leases_held, 20, what=f"balancer leases held by exactly {held}")
    assert progress.state == trainer_agent_pb2.TRAINING_STATE_FINISHED, progress.error_message
    assert killed_at_step < STEPS   # the kill landed while training ran
    assert status.role == controller_pb2.CONTROLLER_ROLE_LEADER and status.leader_address == survivor
    steps = step_records(steps_file)
    assert [s["global_step"] for s in steps] == list(range(1, STEPS + 1))   # every step once, none repeated
    assert progress.samples_generated == progress.samples_consumed + progress.samples_dropped + progress.queue_size
    if moment != "balancer":
        assert "leads the state store" in (tmp_path / "second.log").read_text()   # the standby took over
    assert all(alive)   # no process was restarted: the callers moved to the new leader by themselves
