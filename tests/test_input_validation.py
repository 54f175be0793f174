"""Garbage is refused before anything changes, and errors stay small whatever the bad value's size.

Regression tests of the convergence issue's defect 7: RegisterNode accepted "not an address", a NaN
memory_fraction and slot 99 on a 1-slot node; AddReplicas accepted a megabyte-long replica id;
GetReplica with a 100 KB id answered RESOURCE_EXHAUSTED (the id travelled back in the error);
BeginTrainingStep {} (step 0, no report) was accepted and then blocked step 1.
"""

from __future__ import annotations

import math

import grpc
import pytest

import controller.server
import loadbalancer.server
import replica_agent.server
from mesh_runtime.config import load_config
from mesh_runtime.errors import InvalidArgument, error_info, to_status
from mesh_runtime.validate import ID_MAX_LENGTH, check_id, quote
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2, scheduling_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc, routing_pb2
from rollmesh.replica.v1 import replica_agent_pb2, replica_agent_pb2_grpc

pytestmark = pytest.mark.timeout(60)


def _config(module, **overrides):
    return load_config(module.CONFIG_CLASS, None, overrides={"listen": "127.0.0.1:0", **overrides})


@pytest.fixture
async def controller_stub():
    server, port = await controller.server.SPEC.create(_config(
        controller.server, **{"async_training.use_dynamic_resource_scheduling": True}))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield controller_pb2_grpc.ControllerServiceStub(channel)
    await server.stop(0)


def _node(**changes) -> registry_pb2.RegisterNodeRequest:
    replica = registry_pb2.ReplicaRegistration(replica_id="r0", kind=1, slots=[0], memory_fraction=0.5)
    request = registry_pb2.RegisterNodeRequest(node_id="n1", address="127.0.0.1:5000", slots_total=1,
                                               replicas=[replica])
    for key, value in changes.items():
        target, _, name = key.rpartition(".")
        obj = request.replicas[0] if target == "replica" else request
        if isinstance(value, list):
            del getattr(obj, name)[:]
            getattr(obj, name).extend(value)
        else:
            setattr(obj, name, value)
    return request


@pytest.mark.parametrize("changes, message", [
    ({"address": "not an address"}, "address must be HOST:PORT, got 'not an address'"),
    ({"address": "127.0.0.1:0"}, "address must be HOST:PORT"),
    ({"replica.memory_fraction": math.nan}, "replicas[0].memory_fraction must be a finite number"),
    ({"replica.memory_fraction": 1.5}, "replicas[0].memory_fraction must be in [0.0, 1.0]"),
    ({"replica.slots": [99]}, "replicas[0].slots: slot 99 does not exist on a node with slots_total 1"),
    ({"node_id": "bad id with spaces"}, "node_id must be 1-128 characters"),
    ({"replica.replica_id": "x" * 5000}, "... (5000 characters)"),
])
async def test_register_node_refuses_garbage_and_registers_nothing(controller_stub, changes, message):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await controller_stub.RegisterNode(_node(**changes), timeout=5)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details(), info.value.details()
    assert len(info.value.details()) < 400
    nodes = await controller_stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=5)
    assert list(nodes.nodes) == []
    assert (await controller_stub.RegisterNode(_node(), timeout=5)).accepted_replica_ids == ["r0"]   # sane one


async def test_duplicate_replica_ids_in_one_registration_are_refused(controller_stub):
    request = _node()
    request.replicas.append(registry_pb2.ReplicaRegistration(replica_id="r0", kind=1))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await controller_stub.RegisterNode(request, timeout=5)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "appears twice" in info.value.details()


async def test_a_huge_unknown_id_is_not_found_with_a_short_message(controller_stub):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await controller_stub.GetReplica(registry_pb2.GetReplicaRequest(replica_id="z" * 100_000), timeout=5)
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    assert len(info.value.details()) <= 2100
    assert all(len(v) <= 230 for v in error_info(info.value).metadata.values())


async def test_begin_training_step_without_report_or_with_step_0_changes_nothing(controller_stub):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await controller_stub.BeginTrainingStep(scheduling_pb2.BeginTrainingStepRequest(global_step=1), timeout=5)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "report is required" in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await controller_stub.BeginTrainingStep(scheduling_pb2.BeginTrainingStepRequest(
            global_step=0, report=scheduling_pb2.StepReport()), timeout=5)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "global_step must be >= 1" in info.value.details()
    begin = await controller_stub.BeginTrainingStep(scheduling_pb2.BeginTrainingStepRequest(
        global_step=1, report=scheduling_pb2.StepReport()), timeout=5)   # step 1 is not blocked
    assert not begin.deactivate and begin.next_call == scheduling_pb2.STEP_CALL_COMPLETE_TRAINING_STEP


async def test_add_replicas_refuses_a_megabyte_id_and_bad_addresses_and_adds_nothing():
    server, port = await loadbalancer.server.SPEC.create(_config(loadbalancer.server))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
            good = routing_pb2.ReplicaEndpoint(replica_id="ok", address="127.0.0.1:1", kind=1)
            for bad, message in [
                (routing_pb2.ReplicaEndpoint(replica_id="y" * 1_000_000, address="127.0.0.1:1", kind=1),
                 "replicas[1].replica_id must be 1-128 characters"),
                (routing_pb2.ReplicaEndpoint(replica_id="r2", address="nowhere", kind=1),
                 "replicas[1].address must be HOST:PORT, got 'nowhere'"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.AddReplicas(loadbalancer_pb2.AddReplicasRequest(replicas=[good, bad]), timeout=10)
                assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert message in info.value.details() and len(info.value.details()) < 400
                listed = await stub.ListReplicas(loadbalancer_pb2.ListReplicasRequest(), timeout=5)
                assert list(listed.replicas) == []                 # not even the good one
    finally:
        await server.stop(0)


async def test_launch_replica_refuses_a_bad_id_and_memory_fraction():
    server, port = await replica_agent.server.SPEC.create(_config(replica_agent.server))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
            for request, message in [
                (replica_agent_pb2.LaunchReplicaRequest(replica_id="", kind=1), "replica_id must not be empty"),
                (replica_agent_pb2.LaunchReplicaRequest(replica_id="a b", kind=1), "replica_id must be 1-128"),
                (replica_agent_pb2.LaunchReplicaRequest(replica_id="r", kind=1, memory_fraction=math.inf),
                 "memory_fraction must be a finite number"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.LaunchReplica(request, timeout=5)
                assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()
    finally:
        await server.stop(0)


def test_ids_quotes_and_status_sizes():
    check_id("rollout-0", "node_id")
    check_id("p0#0/1@2", "request_id")
    check_id("a" * ID_MAX_LENGTH, "node_id")
    for bad in ("", "-lead", "a b", "a" * (ID_MAX_LENGTH + 1), "é"):
        with pytest.raises(InvalidArgument):
            check_id(bad, "node_id")
    assert quote("x" * 500) == repr("x" * 100) + "... (500 characters)"
    status = to_status(InvalidArgument("m" * 10_000, metadata={"id": "i" * 10_000}))
    assert len(status.details) < 3000
