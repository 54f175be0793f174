"""Level-triggered routing: the controller keeps the balancer's table equal to the registry.

Regression test of the convergence issue's defect 1: after a balancer restart (or a stray
RemoveReplicas) its table stayed empty until the controller itself restarted.
"""

from __future__ import annotations

import grpc
import pytest

import controller.server
import loadbalancer.server
from mesh_runtime.config import load_config
from rollmesh.common.v1 import generation_pb2, types_pb2
from rollmesh.controller.v1 import events_pb2
from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc, observability_pb2, registry_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc, routing_pb2
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(90)


async def _routed(lb_address: str) -> set[str]:
    async with grpc.aio.insecure_channel(lb_address) as channel:
        reply = await loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel).ListReplicas(
            loadbalancer_pb2.ListReplicasRequest(), timeout=5)
    return {r.endpoint.replica_id for r in reply.replicas}


async def test_a_restarted_balancer_or_a_stray_removal_is_healed_within_an_interval():
    lb_config = load_config(loadbalancer.server.CONFIG_CLASS, None, overrides={"listen": "127.0.0.1:0"})
    lb, lb_port = await loadbalancer.server.SPEC.create(lb_config)
    lb_address = f"127.0.0.1:{lb_port}"
    ctl_config = load_config(controller.server.CONFIG_CLASS, None, overrides={
        "listen": "127.0.0.1:0", "load_balancer_address": lb_address, "reconcile_interval_s": 0.2,
        "lease_ttl_s": 60.0})
    ctl, ctl_port = await controller.server.SPEC.create(ctl_config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ctl_port}") as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(
                node_id="n1", address="127.0.0.1:5999", slots_total=2, replicas=[
                    registry_pb2.ReplicaRegistration(replica_id="s1", kind=types_pb2.REPLICA_KIND_STANDALONE,
                                                       state=types_pb2.REPLICA_STATE_ACTIVE, slots=[0]),
                    registry_pb2.ReplicaRegistration(replica_id="h1", kind=types_pb2.REPLICA_KIND_HYBRID,
                                                       state=types_pb2.REPLICA_STATE_SLEEPING, slots=[1])]),
                timeout=5)
        assert await wait_until(lambda: _routed(lb_address), 10) == {"s1"}     # the sleeping hybrid is not routed

        # a stray RemoveReplicas, and a stray AddReplicas of a replica the registry does not know
        async with grpc.aio.insecure_channel(lb_address) as channel:
            lb_stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
            await lb_stub.RemoveReplicas(loadbalancer_pb2.RemoveReplicasRequest(replica_ids=["s1"]), timeout=5)
            await lb_stub.AddReplicas(loadbalancer_pb2.AddReplicasRequest(replicas=[
                routing_pb2.ReplicaEndpoint(replica_id="rogue", address="127.0.0.1:6000", kind=1),
                routing_pb2.ReplicaEndpoint(replica_id="h1", address="127.0.0.1:5999", kind=2)]), timeout=5)

        async def healed() -> bool:
            return await _routed(lb_address) == {"s1"}
        await wait_until(healed, 10, what="routing restored after stray calls")

        # the balancer restarts empty on the same port
        await lb.stop(0)
        lb, _ = await loadbalancer.server.SPEC.create(
            load_config(loadbalancer.server.CONFIG_CLASS, None, overrides={"listen": lb_address}))
        assert await _routed(lb_address) == set()
        await wait_until(healed, 10, what="routing restored after a balancer restart")
    finally:
        await ctl.stop(0)
        await lb.stop(0)


async def test_a_replica_the_balancer_ejects_is_an_event_at_the_controller():
    lb_config = load_config(loadbalancer.server.CONFIG_CLASS, None, overrides={
        "listen": "127.0.0.1:0", "outlier_detection": {"consecutive_failures": 1, "base_ejection_s": 30.0}})
    lb, lb_port = await loadbalancer.server.SPEC.create(lb_config)
    lb_address = f"127.0.0.1:{lb_port}"
    ctl_config = load_config(controller.server.CONFIG_CLASS, None, overrides={
        "listen": "127.0.0.1:0", "load_balancer_address": lb_address, "reconcile_interval_s": 0.2,
        "lease_ttl_s": 60.0})
    ctl, ctl_port = await controller.server.SPEC.create(ctl_config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ctl_port}") as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(   # nothing listens at its address
                node_id="n1", address="127.0.0.1:5999", slots_total=2, replicas=[
                    registry_pb2.ReplicaRegistration(replica_id=r, kind=types_pb2.REPLICA_KIND_STANDALONE,
                                                       state=types_pb2.REPLICA_STATE_ACTIVE, slots=[i])
                    for i, r in enumerate(("s1", "s2"))]), timeout=5)
            assert await wait_until(lambda: _routed(lb_address), 10) == {"s1", "s2"}
            async with grpc.aio.insecure_channel(lb_address) as lb_channel:
                call = loadbalancer_pb2_grpc.LoadBalancerServiceStub(lb_channel).Generate(
                    loadbalancer_pb2.GenerateRequest(request_id="doomed", prompt_token_ids=[1],
                                                     sampling_params=generation_pb2.SamplingParams(max_tokens=2)),
                    timeout=3)
                with pytest.raises(grpc.aio.AioRpcError):
                    async for _ in call:
                        pass

            async def ejected():
                newest = (await stub.GetStatus(controller_pb2.GetStatusRequest())).last_event_sequence
                found = []
                async for message in stub.WatchEvents(observability_pb2.WatchEventsRequest(include_history=True)):
                    if message.event.type == events_pb2.EVENT_TYPE_REPLICA_EJECTED:
                        found.append(message.event)
                    if message.event.sequence >= newest:
                        break
                return found
            events = await wait_until(ejected, 10, what="a REPLICA_EJECTED event")
            assert len(events) == 1 and events[0].replica_id in ("s1", "s2")
            assert "consecutive failures" in events[0].reason and events[0].attributes["ejections"] == "1"
    finally:
        await ctl.stop(0)
        await lb.stop(0)
