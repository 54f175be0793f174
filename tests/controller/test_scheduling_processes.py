"""The step protocol end to end: controller, balancer, trainer agent and replica agents as processes.

Step 1 activates the hybrid replica after a weight sync (it takes traffic only
at the new version); step 2 deactivates it (remove -> abort -> sleep, traced)
while requests are in flight on it, and those requests finish elsewhere; with
enough samples buffered the hybrid weight sync is skipped and said so.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rollmesh.common.v1 import generation_pb2, types_pb2

from rollmesh.controller.v1 import events_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, observability_pb2, registry_pb2, scheduling_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as lb_pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc
from rollmesh.loadbalancer.v1 import routing_pb2 as lb_routing
from tests.otlp_receiver import start_receiver
from tests.processes import clean_env, running_server
from tests.waiting import wait_until as until

pytestmark = pytest.mark.timeout(240)

AGENT = """node_id: {node}
slots: 1
controller_address: {controller}
stream_interval: 4
weight_transfer: {{gloo_interface: lo}}
engine_options: {{max_batch_size: 256}}
replicas: [{{replica_id: {replica}, kind: {kind}}}]
"""
CONTROLLER = """load_balancer_address: {lb}
trainer_address: {trainer}
lease_ttl_s: 5
load_report_interval_s: 0.2
async_training:
  use_dynamic_resource_scheduling: true
  dynamic_schedule_policy: default
  trigger_parameter_sync_step: 1
  require_batches: 1
  ppo_mini_batch_size: 8
  weight_sync_timeout_s: 60
"""


async def routed_versions(bal) -> dict[str, int]:
    reply = await bal.ListReplicas(lb_pb.ListReplicasRequest())
    return {r.endpoint.replica_id: r.endpoint.weight_version for r in reply.replicas}


async def generate(bal, request_id: str, max_tokens: int):
    req = lb_pb.GenerateRequest(request_id=request_id, prompt_token_ids=[3, 4, 5],
                                sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    final = None
    async for msg in bal.Generate(req, timeout=120):
        final = msg
    return final


def report(**kw) -> scheduling_pb2.StepReport:
    return scheduling_pb2.StepReport(required_samples=8, trigger_parameter_sync_step=1, **kw)


async def test_activate_after_sync_then_deactivate_in_order_and_skip_the_hybrid_sync(tmp_path):
    receiver_server, receiver, otlp_port = await start_receiver()
    env = clean_env(GLOO_SOCKET_IFNAME="lo", OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{otlp_port}",
                    OTEL_BSP_SCHEDULE_DELAY="100")
    (tmp_path / "trainer.yaml").write_text("model_seed: 5\nadopt_requested_versions: true\n"
        "weight_transfer: {gloo_interface: lo}\n")
    try:
        with running_server("lb", ["--listen", "127.0.0.1:0"], env=env, log_path=tmp_path / "lb.log") as (lb, _), \
             running_server("trainer-agent", ["--config", str(tmp_path / "trainer.yaml"), "--listen", "127.0.0.1:0"],
                            env=env, log_path=tmp_path / "trainer.log") as (trainer, _):
            (tmp_path / "controller.yaml").write_text(CONTROLLER.format(lb=lb, trainer=trainer))
            with running_server("controller", ["--config", str(tmp_path / "controller.yaml"), "--listen",
                                               "127.0.0.1:0"], env=env, log_path=tmp_path / "c.log") as (ctl_addr, _):
                agents = []
                for node, replica, kind in (("sa", "s0", "STANDALONE"), ("hy", "h0", "HYBRID")):
                    (tmp_path / f"{node}.yaml").write_text(AGENT.format(node=node, controller=ctl_addr,
                                                                        replica=replica, kind=kind))
                    agents.append(running_server("replica-agent", ["--config", str(tmp_path / f"{node}.yaml"),
                                                                   "--listen", "127.0.0.1:0"], env=env,
                                                 log_path=tmp_path / f"{node}.log"))
                with agents[0], agents[1]:
                    await _scenario(ctl_addr, lb, receiver)
    finally:
        await receiver_server.stop(None)


async def _scenario(ctl_addr: str, lb: str, receiver) -> None:
    async with grpc.aio.insecure_channel(ctl_addr) as cch, grpc.aio.insecure_channel(lb) as lch:
        ctl = controller_pb2_grpc.ControllerServiceStub(cch)
        bal = loadbalancer_pb2_grpc.LoadBalancerServiceStub(lch)

        async def registered():
            reply = await ctl.ListReplicas(registry_pb2.ListReplicasRequest())
            return len(reply.replicas) == 2
        await until(registered)
        assert await routed_versions(bal) == {"s0": 0}  # the hybrid sleeps: not routed

        # Step 1: the queue is short (a gap exists) -> activate after the weight sync.
        begin = await ctl.BeginTrainingStep(scheduling_pb2.BeginTrainingStepRequest(global_step=1, report=report()))
        assert not begin.deactivate
        with pytest.raises(grpc.aio.AioRpcError) as info:  # out of order: Complete is not next... Release is not
            await ctl.ReleaseHybridReplicas(scheduling_pb2.ReleaseHybridReplicasRequest(global_step=1))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "CompleteTrainingStep" in info.value.details()
        done = await ctl.CompleteTrainingStep(scheduling_pb2.CompleteTrainingStepRequest(
            global_step=1, weight_version=1, report=report(expected_samples=64, total_generated_samples=8)))
        assert done.hybrid_activated and not done.hybrid_sync_skipped
        assert [r.ok for r in done.standalone_sync.replica_results] == [True]
        assert [r.replica_id for r in done.hybrid_sync.replica_results] == ["h0"]
        assert await routed_versions(bal) == {"s0": 1, "h0": 1}  # traffic only at the new version
        h0 = (await ctl.GetReplica(registry_pb2.GetReplicaRequest(replica_id="h0"))).replica
        assert h0.state == types_pb2.REPLICA_STATE_ACTIVE and h0.weight_version == 1

        # Step 2: deactivate while requests run on the hybrid replica; they finish elsewhere.
        in_flight = [asyncio.create_task(generate(bal, f"r{i}", 300)) for i in range(12)]
        await until(lambda: _busy(bal, "h0"))
        begin = await ctl.BeginTrainingStep(scheduling_pb2.BeginTrainingStepRequest(global_step=2, report=report()))
        assert begin.deactivate and begin.wait_samples == int(0.3 * 8 * 1)
        released = await ctl.ReleaseHybridReplicas(scheduling_pb2.ReleaseHybridReplicasRequest(
            global_step=2, buffered_samples=begin.wait_samples))
        assert list(released.released_replica_ids) == ["h0"]
        assert await routed_versions(bal) == {"s0": 1}
        finals = await asyncio.gather(*in_flight)
        assert all(f.usage.completion_tokens == 300 for f in finals)
        moved = [f for f in finals if any(a.replica_id == "h0" and a.outcome == lb_routing.ATTEMPT_OUTCOME_ABORTED
                                          for a in f.attempts)]
        assert moved and all(f.attempts[-1].replica_id == "s0" for f in moved)

        # Enough samples buffered: no activation, the hybrid weight sync is skipped.
        done = await ctl.CompleteTrainingStep(scheduling_pb2.CompleteTrainingStepRequest(
            global_step=2, weight_version=2, report=report(expected_samples=16, total_generated_samples=200)))
        assert not done.hybrid_activated and done.hybrid_sync_skipped and done.bytes_saved > 0
        h0 = (await ctl.GetReplica(registry_pb2.GetReplicaRequest(replica_id="h0"))).replica
        assert h0.state == types_pb2.REPLICA_STATE_SLEEPING and h0.weight_version == 1
        skipped = [m.event async for m in _history(ctl, events_pb2.EVENT_TYPE_WEIGHT_SYNC_SKIPPED)]
        assert skipped and skipped[-1].global_step == 2

    def deactivation_children(spans):
        parent = next((s for s in spans if s.name == "hybrid.deactivate"), None)
        if parent is None:
            return []
        ids = {parent.span_id}
        changed = True
        while changed:  # descendants within the controller
            new = {s.span_id for s in spans if s.parent_span_id in ids and s.service == "rollmesh-controller"}
            changed = not new <= ids
            ids |= new
        return sorted((s for s in spans if s.parent_span_id in ids and s.kind == 3), key=lambda s: s.start_ns)

    await receiver.wait_for(lambda spans: len(deactivation_children(spans)) >= 3)
    calls = [s.name.rsplit("/", 1)[1] for s in deactivation_children(receiver.spans)]
    assert calls.index("RemoveReplicas") < calls.index("AbortRequests") < calls.index("Sleep")


async def _busy(bal, replica_id: str) -> bool:
    reply = await bal.ListReplicas(lb_pb.ListReplicasRequest())
    return any(r.endpoint.replica_id == replica_id and r.in_flight >= 2 for r in reply.replicas)


async def _history(ctl, event_type):
    """Every retained event of ``event_type`` up to now (replay until the newest sequence)."""
    from rollmesh.controller.v1 import controller_pb2

    newest = (await ctl.GetStatus(controller_pb2.GetStatusRequest())).last_event_sequence
    call = ctl.WatchEvents(observability_pb2.WatchEventsRequest(include_history=True))
    async for message in call:
        if message.event.type == event_type:
            yield message
        if message.event.sequence >= newest:
            break
    call.cancel()
