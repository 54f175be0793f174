"""The fully-async loop end to end: controller, balancer and replica agents as processes.

The trainer agent runs in this process (``SPEC.create``), so the loop's GRPO
trainer updates the very model its weight source broadcasts: every
``CompleteTrainingStep(weight_version=v)`` makes the controller send version v
to the replicas over gloo. One standalone and one hybrid replica (tiny-llama,
the trainer's seed) generate the copy task through the load balancer.
"""

from __future__ import annotations


import grpc
import pytest
from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc

from weight_transfer import WeightTransferConfig
from tests.processes import clean_env, running_server
from trainer_agent.config import TrainerAgentConfig
from trainer_agent.driver.lb_client import LoadBalancerGenerate
from trainer_agent.driver.loop import FullyAsyncLoop, StepRecord, task_prompts
from trainer_agent.driver.mesh_calls import lb_replica_count
from trainer_agent.driver.rollouter import RolloutConfig
from trainer_agent.server import SPEC
from trainer_agent.training import task
from trainer_agent.training.grpo import GrpoConfig, GrpoTrainer
from tests.waiting import wait_until as until

pytestmark = pytest.mark.timeout(240)

SEED = 5
PROMPTS, N, STEPS = 4, 4, 5
AGENT = """node_id: {node}
slots: 1
model_seed: {seed}
controller_address: {controller}
stream_interval: 4
weight_transfer: {{gloo_interface: lo}}
engine_options: {{max_batch_size: 64}}
replicas: [{{replica_id: {replica}, kind: {kind}}}]
"""
CONTROLLER = """load_balancer_address: {lb}
trainer_address: {trainer}
lease_ttl_s: 5
load_report_interval_s: 0.2
async_training:
  use_dynamic_resource_scheduling: true
  dynamic_schedule_policy: fixed_ratio
  dynamic_schedule_deactivate_ratio: 0.25
  deactivate_wait_timeout_s: 20
  trigger_parameter_sync_step: 1
  require_batches: 1
  staleness_threshold: 0.5
  ppo_mini_batch_size: {required}
  weight_sync_timeout_s: 60
"""


async def test_fully_async_loop_runs_the_step_protocol_and_syncs_the_trained_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    env = clean_env(GLOO_SOCKET_IFNAME="lo")
    config = TrainerAgentConfig(listen="127.0.0.1:0", model_seed=SEED, adopt_requested_versions=False,
                                weight_transfer=WeightTransferConfig(gloo_interface="lo"))
    config.validate()
    trainer_server, _ = await SPEC.create(config)
    try:
        source = trainer_server.services[0].servicer.node.source
        with running_server("lb", ["--listen", "127.0.0.1:0"], env=env, log_path=tmp_path / "lb.log") as (lb, _):
            (tmp_path / "controller.yaml").write_text(CONTROLLER.format(
                lb=lb, trainer=trainer_server.address, required=PROMPTS * N))
            with running_server("controller", ["--config", str(tmp_path / "controller.yaml"), "--listen",
                                               "127.0.0.1:0"], env=env, log_path=tmp_path / "c.log") as (ctl, _):
                agents = []
                for node, replica, kind in (("sa", "s0", "STANDALONE"), ("hy", "h0", "HYBRID")):
                    (tmp_path / f"{node}.yaml").write_text(AGENT.format(node=node, controller=ctl, seed=SEED,
                                                                        replica=replica, kind=kind))
                    agents.append(running_server("replica-agent", ["--config", str(tmp_path / f"{node}.yaml"),
                                                                   "--listen", "127.0.0.1:0"], env=env,
                                                 log_path=tmp_path / f"{node}.log"))
                with agents[0], agents[1]:
                    await _scenario(ctl, lb, source)
    finally:
        await trainer_server.stop(0)


async def _scenario(ctl_addr: str, lb: str, source) -> None:
    async with grpc.aio.insecure_channel(ctl_addr) as cch, grpc.aio.insecure_channel(lb) as lch:
        ctl = controller_pb2_grpc.ControllerServiceStub(cch)
        bal = loadbalancer_pb2_grpc.LoadBalancerServiceStub(lch)

        async def registered():
            reply = await ctl.ListReplicas(registry_pb2.ListReplicasRequest())
            return len(reply.replicas) == 2
        await until(registered)
        await until(lambda: _routed(bal))

        synced_versions: list[dict[str, int]] = []

        async def after_step(record: StepRecord) -> None:
            assert source.weight_version == record.weight_version
            reply = await ctl.ListReplicas(registry_pb2.ListReplicasRequest())
            replicas = {r.replica_id: r for r in reply.replicas}
            synced_versions.append({rid: replicas[rid].weight_version for rid in record.synced_replica_ids})
            assert replicas["s0"].weight_version == record.weight_version
            for r in replicas.values():
                if r.state == types_pb2.REPLICA_STATE_ACTIVE:
                    assert r.weight_version == record.weight_version, (r.replica_id, record.global_step)

        rollout = RolloutConfig(n=N, ppo_mini_batch_size=PROMPTS, trigger_parameter_sync_step=1,
                                staleness_threshold=0.5, concurrent_samples_per_replica=8,
                                max_tokens=task.max_completion_tokens(task.make_prompts(1, SEED)[0][0]))
        trainer = GrpoTrainer.from_weight_source(source, GrpoConfig(lr=3e-3))
        loop = FullyAsyncLoop(ctl, LoadBalancerGenerate(bal, timeout_s=60), trainer, rollout,
                              task_prompts(task, 16, SEED), task.reward, replica_count=lb_replica_count(bal),
                              rpc_timeout_s=60, sync_timeout_s=90, collect_timeout_s=60, replica_poll_s=0.2,
                              on_step=after_step)
        records = await loop.run(STEPS)

    assert [r.global_step for r in records] == list(range(1, STEPS + 1))
    assert [r.weight_version for r in records] == list(range(1, STEPS + 1))
    assert all(set(v.values()) == {r.weight_version} for v, r in zip(synced_versions, records))
    assert all("s0" in r.synced_replica_ids for r in records)
    for r in records:
        assert 0.0 <= r.reward_mean <= 1.0
        assert r.step_consumed == PROMPTS * N
        assert {"reward", "adv", "update_actor", "step", "wait_for_enough_samples", "param_sync"} <= set(r.timing_raw)
        assert len(r.step_wait_times) == len(r.step_wait_samples) == 1
    last = records[-1]
    assert last.generated == last.consumed + last.dropped + last.queue_size
    assert last.consumed == STEPS * PROMPTS * N
    activated = [r.global_step for r in records if r.hybrid_activated]
    assert activated, [(r.global_step, r.deactivated, r.generated) for r in records]
    # An activated hybrid is released at the next Begin (after a bounded wait).
    for r in records[1:]:
        if r.global_step - 1 in activated:
            assert r.deactivated and r.released_replica_ids == ["h0"]
    assert any("h0" in r.synced_replica_ids for r in records)
    print("\nstep  ver  reward  wait_s  wait_samples  queue  gen  cons  drop  deact  activ  param_sync_s")
    for r in records:
        print(f"{r.global_step:4d} {r.weight_version:4d} {r.reward_mean:7.3f} {r.step_wait_times[0]:7.2f} "
              f"{r.step_wait_samples[0]:12d} {r.queue_size:6d} {r.generated:4d} {r.consumed:5d} {r.dropped:5d} "
              f"{r.deactivated!s:>6} {r.hybrid_activated!s:>6} {r.timing_raw['param_sync']:12.2f}")


async def _routed(bal) -> bool:
    return await lb_replica_count(bal)() >= 1


# -- failures end the loop with an exception (in process, no servers) --------------------------------


class _FakeController:
    """Answers the step protocol; ``fail_complete`` makes CompleteTrainingStep raise like a gRPC error."""

    def __init__(self, fail_complete: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_complete = fail_complete

    async def BeginTrainingStep(self, request, timeout=None):
        from rollmesh.controller.v1 import scheduling_pb2
        self.calls.append("begin")
        return scheduling_pb2.BeginTrainingStepResponse()

    async def CompleteTrainingStep(self, request, timeout=None):
        from rollmesh.controller.v1 import scheduling_pb2
        self.calls.append("complete")
        if self.fail_complete:
            raise RuntimeError("controller unavailable")
        return scheduling_pb2.CompleteTrainingStepResponse()


def _local_loop(controller, generate) -> FullyAsyncLoop:
    from trainer_agent.weight_source import TorchWeightSource

    source = TorchWeightSource("tiny-llama", seed=SEED)
    source.load()
    # _echo's logprobs are made up, not the model's: no on-policy check
    trainer = GrpoTrainer.from_weight_source(source, GrpoConfig(logprob_mismatch_bound=0))

    async def one() -> int:
        return 1
    return FullyAsyncLoop(controller, generate, trainer, RolloutConfig(n=2, ppo_mini_batch_size=1, max_tokens=4,
                                                                      max_retries=0),
                          task_prompts(task, 4, SEED), task.reward, replica_count=one, collect_timeout_s=10)


async def _echo(request):
    from trainer_agent.driver.rollouter import GenerationResult, Segment
    return GenerationResult([Segment(token_ids=[11, 12, 1], logprobs=[-1.0, -1.0, -1.0])])


async def test_a_rollouter_failure_fails_the_loop():
    async def broken(request):
        raise ConnectionError("balancer gone")
    ctl = _FakeController()
    with pytest.raises(Exception, match="balancer gone") as info:
        await _local_loop(ctl, broken).run(3)
    assert type(info.value).__name__ == "RolloutFailed"
    assert "complete" not in ctl.calls


async def test_an_rpc_error_fails_the_loop():
    ctl = _FakeController(fail_complete=True)
    loop = _local_loop(ctl, _echo)
    with pytest.raises(RuntimeError, match="controller unavailable"):
        await loop.run(3)
    assert ctl.calls == ["begin", "complete"] and loop.records == []
    assert loop.rollouter.active_tasks == 0


async def test_local_loop_steps_with_a_fake_controller():
    ctl = _FakeController()
    records = await _local_loop(ctl, _echo).run(2)
    # trigger_parameter_sync_step 4 (the default): four collections and GRPO updates per global step.
    assert [r.weight_version for r in records] == [4, 8] and ctl.calls == ["begin", "complete"] * 2
    assert all(len(r.step_wait_times) == 4 and r.step_consumed == 4 * 2 for r in records)
    assert all(r.reward_mean > 0 for r in records)
