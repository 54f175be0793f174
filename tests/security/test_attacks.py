"""The attacks of the "secure mesh" issue, replayed against a mutual-TLS mesh of real processes.

Each one was a working attack on the plaintext mesh: weights pushed into a
serving replica, weight updates frozen, prompts hijacked by registering a
node, serving taken down, the step protocol driven by a stranger. Each now
fails with the right status, and the mesh is checked unchanged afterwards.
"""

from __future__ import annotations

import grpc
import pytest

from mesh_runtime.channels import open_channel
from mesh_runtime.errors import error_info
from rollmesh.common.v1 import generation_pb2, types_pb2, weights_pb2
from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc, registry_pb2, scheduling_pb2, weight_sync_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as lb_pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc
from rollmesh.replica.v1 import replica_agent_pb2 as ra_pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc
from rollmesh.weights.v1 import weight_source_pb2 as ws
from rollmesh.weights.v1 import weight_source_pb2_grpc
from tests.processes import clean_env, running_server
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)

AGENT = """node_id: sa
slots: 1
controller_address: {controller}
stream_interval: 4
weight_transfer: {{gloo_interface: lo}}
replicas: [{{replica_id: s0, kind: STANDALONE}}]
{tls}"""
CONTROLLER = """load_balancer_address: {lb}
trainer_address: {trainer}
lease_ttl_s: 10
load_report_interval_s: 0.3
{tls}"""


@pytest.fixture(scope="module")
def mesh(pki, tmp_path_factory):
    d = tmp_path_factory.mktemp("attacks")
    env = clean_env(GLOO_SOCKET_IFNAME="lo")
    (d / "lb.yaml").write_text(pki.yaml("lb"))
    (d / "trainer.yaml").write_text("model_seed: 5\nadopt_requested_versions: true\n"
        "weight_transfer: {gloo_interface: lo}\n" + pki.yaml("trainer-agent"))
    with running_server("lb", ["--config", str(d / "lb.yaml"), "--listen", "127.0.0.1:0"], env=env,
                        log_path=d / "lb.log") as (lb, _), \
         running_server("trainer-agent", ["--config", str(d / "trainer.yaml"), "--listen", "127.0.0.1:0"], env=env,
                        log_path=d / "trainer.log") as (trainer, _):
        (d / "c.yaml").write_text(CONTROLLER.format(lb=lb, trainer=trainer, tls=pki.yaml("controller")))
        with running_server("controller", ["--config", str(d / "c.yaml"), "--listen", "127.0.0.1:0"], env=env,
                            log_path=d / "c.log") as (controller, _):
            (d / "sa.yaml").write_text(AGENT.format(controller=controller, tls=pki.yaml("replica-agent", "sa")))
            with running_server("replica-agent", ["--config", str(d / "sa.yaml"), "--listen", "127.0.0.1:0"],
                                env=env, log_path=d / "sa.log") as (agent, _):
                yield {"lb": lb, "controller": controller, "trainer": trainer, "agent": agent}


def _as(pki, role: str, address: str, name: str = "n0") -> grpc.aio.Channel:
    return open_channel(address, tls=pki.tls(role, name))


async def _denied(call, reason: str = "ROLE_NOT_ALLOWED") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
    assert error_info(info.value).reason == reason
    return info.value.details()


async def _replica(pki, mesh):
    async with _as(pki, "operator-readonly", mesh["controller"]) as ch:
        stub = controller_pb2_grpc.ControllerServiceStub(ch)

        async def ready():
            reply = await stub.ListReplicas(registry_pb2.ListReplicasRequest())
            return [r for r in reply.replicas if r.state == types_pb2.REPLICA_STATE_ACTIVE]
        replicas = await wait_until(ready, timeout_s=120)
        node = (await stub.GetNode(registry_pb2.GetNodeRequest(node_id="sa"))).node
        return replicas[0], node


async def _generate(pki, mesh, request_id: str):
    async with _as(pki, "client", mesh["lb"]) as ch:
        final = None
        req = lb_pb.GenerateRequest(request_id=request_id, prompt_token_ids=[3, 4, 5],
                                    sampling_params=generation_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
        async for msg in loadbalancer_pb2_grpc.LoadBalancerServiceStub(ch).Generate(req, timeout=60):
            final = msg
        return final


async def test_weights_cannot_be_pushed_into_a_replica_by_anyone_but_the_controller(pki, mesh):
    before, _ = await _replica(pki, mesh)
    plan = weights_pb2.WeightSyncPlan(weight_version=31337)
    for role in ("trainer-agent", "lb", "operator", "client"):   # the attacker ran its own trainer agent, ...
        async with _as(pki, role, mesh["agent"]) as ch:
            agent = replica_agent_pb2_grpc.ReplicaAgentServiceStub(ch)
            details = await _denied(agent.ReceiveWeights(ra_pb.ReceiveWeightsRequest(replica_ids=["s0"], plan=plan),
                                                        timeout=10))
            assert "needs the role controller" in details and f"spiffe://rollmesh/{role}/" in details
            source = weight_source_pb2_grpc.WeightSourceServiceStub(ch)
            await _denied(source.PrepareWeightSync(ws.PrepareWeightSyncRequest(source_id="s0"), timeout=10))
    after, _ = await _replica(pki, mesh)
    assert after.weight_version == before.weight_version
    assert (await _generate(pki, mesh, "after-push")).weight_version == before.weight_version


async def test_weight_updates_cannot_be_frozen_by_a_non_trainer(pki, mesh):
    before, _ = await _replica(pki, mesh)
    for role in ("client", "operator", "replica-agent", "controller"):
        async with _as(pki, role, mesh["controller"]) as ch:
            stub = controller_pb2_grpc.ControllerServiceStub(ch)
            details = await _denied(stub.SyncWeights(weight_sync_pb2.SyncWeightsRequest(weight_version=1000000),
                                                     timeout=10))
            assert "needs the role trainer-agent" in details
    after, _ = await _replica(pki, mesh)
    assert after.weight_version == before.weight_version


async def test_an_agent_cannot_register_or_deregister_another_nodes_id(pki, mesh):
    _, node = await _replica(pki, mesh)
    async with _as(pki, "replica-agent", mesh["controller"], name="evil") as ch:
        stub = controller_pb2_grpc.ControllerServiceStub(ch)
        details = await _denied(stub.RegisterNode(registry_pb2.RegisterNodeRequest(
            node_id="sa", address="127.0.0.1:1", slots_total=1), timeout=10), reason="NOT_YOUR_NODE")
        assert "spiffe://rollmesh/replica-agent/evil" in details and "'sa'" in details
        await _denied(stub.DeregisterNode(registry_pb2.DeregisterNodeRequest(node_id="sa"), timeout=10),
                      reason="NOT_YOUR_NODE")
    async with _as(pki, "client", mesh["controller"]) as ch:   # not an agent at all
        await _denied(controller_pb2_grpc.ControllerServiceStub(ch).RegisterNode(
            registry_pb2.RegisterNodeRequest(node_id="x", address="127.0.0.1:1", slots_total=1), timeout=10))
    replica, after = await _replica(pki, mesh)
    assert after.address == node.address and replica.state == types_pb2.REPLICA_STATE_ACTIVE
    assert (await _generate(pki, mesh, "after-register")).finish_reason == generation_pb2.FINISH_REASON_LENGTH


async def test_only_a_balancer_can_register_a_balancer_and_only_itself(pki, mesh):
    """A rogue balancer in the set would receive clients' prompts: registering one takes an lb certificate
    that names it."""
    async with _as(pki, "client", mesh["controller"]) as ch:
        await _denied(controller_pb2_grpc.ControllerServiceStub(ch).RegisterBalancer(
            registry_pb2.RegisterBalancerRequest(balancer_id="n0", address="127.0.0.1:1"), timeout=10))
    async with _as(pki, "lb", mesh["controller"], name="evil") as ch:
        stub = controller_pb2_grpc.ControllerServiceStub(ch)
        details = await _denied(stub.RegisterBalancer(registry_pb2.RegisterBalancerRequest(
            balancer_id="lb-good", address="127.0.0.1:1"), timeout=10), reason="NOT_YOUR_BALANCER")
        assert "spiffe://rollmesh/lb/evil" in details
        reply = await stub.ListBalancers(registry_pb2.ListBalancersRequest(), timeout=10)
        assert "lb-good" not in [b.balancer_id for b in reply.balancers]
    async with _as(pki, "lb", mesh["controller"], name="lb-good") as ch:   # its own id: accepted, then it leaves
        stub = controller_pb2_grpc.ControllerServiceStub(ch)
        await stub.RegisterBalancer(registry_pb2.RegisterBalancerRequest(balancer_id="lb-good",
                                                                         address="127.0.0.1:1"), timeout=10)
        async with _as(pki, "lb", mesh["controller"], name="evil") as evil:
            await _denied(controller_pb2_grpc.ControllerServiceStub(evil).DeregisterBalancer(
                registry_pb2.DeregisterBalancerRequest(balancer_id="lb-good"), timeout=10),
                reason="NOT_YOUR_BALANCER")
        await stub.DeregisterBalancer(registry_pb2.DeregisterBalancerRequest(balancer_id="lb-good"), timeout=10)
        reply = await stub.ListBalancers(registry_pb2.ListBalancersRequest(), timeout=10)
        assert [b.balancer_id for b in reply.balancers] == [mesh["lb"]]   # the configured one alone


async def test_serving_cannot_be_taken_down_by_a_non_controller(pki, mesh):
    for role in ("operator", "client", "trainer-agent", "replica-agent"):
        async with _as(pki, role, mesh["agent"]) as ch:
            agent = replica_agent_pb2_grpc.ReplicaAgentServiceStub(ch)
            await _denied(agent.StopReplica(ra_pb.StopReplicaRequest(replica_id="s0"), timeout=10))
            await _denied(agent.Sleep(ra_pb.SleepRequest(replica_id="s0"), timeout=10))
            await _denied(agent.LaunchReplica(ra_pb.LaunchReplicaRequest(replica_id="x"), timeout=10))
        async with _as(pki, role, mesh["lb"]) as ch:
            balancer = loadbalancer_pb2_grpc.LoadBalancerServiceStub(ch)
            await _denied(balancer.RemoveReplicas(lb_pb.RemoveReplicasRequest(replica_ids=["s0"]), timeout=10))
    async with _as(pki, "client", mesh["lb"]) as ch:
        routed = await loadbalancer_pb2_grpc.LoadBalancerServiceStub(ch).ListReplicas(lb_pb.ListReplicasRequest())
    assert [r.endpoint.replica_id for r in routed.replicas] == ["s0"]
    replica, _ = await _replica(pki, mesh)
    assert replica.state == types_pb2.REPLICA_STATE_ACTIVE


async def test_the_step_protocol_is_the_trainers_alone(pki, mesh):
    async with _as(pki, "operator-readonly", mesh["controller"]) as ch:
        before = await controller_pb2_grpc.ControllerServiceStub(ch).GetSchedulerState(
            scheduling_pb2.GetSchedulerStateRequest())
    for role in ("client", "operator", "replica-agent"):
        async with _as(pki, role, mesh["controller"]) as ch:
            stub = controller_pb2_grpc.ControllerServiceStub(ch)
            await _denied(stub.BeginTrainingStep(scheduling_pb2.BeginTrainingStepRequest(global_step=1), timeout=10))
            await _denied(stub.ReleaseHybridReplicas(scheduling_pb2.ReleaseHybridReplicasRequest(global_step=1),
                                                     timeout=10))
            await _denied(stub.CompleteTrainingStep(scheduling_pb2.CompleteTrainingStepRequest(global_step=1),
                                                    timeout=10))
    async with _as(pki, "operator-readonly", mesh["controller"]) as ch:
        after = await controller_pb2_grpc.ControllerServiceStub(ch).GetSchedulerState(
            scheduling_pb2.GetSchedulerStateRequest())
    assert after == before


async def test_plaintext_reaches_no_server(mesh):
    for name, address in mesh.items():
        async with grpc.aio.insecure_channel(address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await controller_pb2_grpc.ControllerServiceStub(ch).GetStatus(controller_pb2.GetStatusRequest(),
                                                                              timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, name


async def test_a_forged_manifest_is_not_swapped_in_even_from_the_controllers_own_channel(pki, mesh):
    # the replica gets a plan whose manifest is not the one the sender signs (a forged or swapped plan):
    # the sender's manifest tag does not match, the replica keeps serving its weights and says why
    import asyncio
    import os

    before, _ = await _replica(pki, mesh)
    async with _as(pki, "controller", mesh["trainer"]) as tch, _as(pki, "controller", mesh["agent"]) as ach:
        trainer = weight_source_pb2_grpc.WeightSourceServiceStub(tch)
        agent = replica_agent_pb2_grpc.ReplicaAgentServiceStub(ach)
        prepared = await trainer.PrepareWeightSync(ws.PrepareWeightSyncRequest(weight_version=1), timeout=60)
        genuine = weights_pb2.WeightSyncPlan(
            sync_id="forged-1", weight_version=1, group_id="g-forged", rendezvous_host=prepared.rendezvous_host,
            rendezvous_port=prepared.rendezvous_port, world_size=2, backend=weights_pb2.PROCESS_GROUP_BACKEND_GLOO,
            manifest=prepared.manifest, source=prepared.source, sync_key=os.urandom(32),
            members=[weights_pb2.WeightSyncMember(rank=0),
                     weights_pb2.WeightSyncMember(rank=1, replica_id="s0", address=mesh["agent"])])
        genuine.timeout.FromSeconds(60)
        forged = weights_pb2.WeightSyncPlan()
        forged.CopyFrom(genuine)
        forged.manifest.bucket_digests[0] = "0" * 64
        sent, received = await asyncio.gather(
            trainer.SendWeights(ws.SendWeightsRequest(plan=genuine), timeout=90),
            agent.ReceiveWeights(ra_pb.ReceiveWeightsRequest(replica_ids=["s0"], plan=forged), timeout=90))
    result = received.results[0]
    assert not result.checksum_ok and result.weight_version == before.weight_version
    assert "not authentic" in result.error_message and "manifest tag" in result.error_message
    after, _ = await _replica(pki, mesh)
    assert after.weight_version == before.weight_version
    assert (await _generate(pki, mesh, "after-forged")).weight_version == before.weight_version
