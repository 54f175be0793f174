"""Malformed input on every server is INVALID_ARGUMENT and changes nothing; one server per port.

Regression tests of the convergence issue's defects 5 (unknown enum values answered INTERNAL),
6 (undecodable request bytes answered UNKNOWN) and 9 (a second server bound the same port).
"""

from __future__ import annotations

import socket
import subprocess
import sys

import grpc
import pytest

import controller.server
import loadbalancer.server
import replica_agent.server
import trainer_agent.server
from mesh_runtime.config import load_config
from mesh_runtime.decoding import unknown_enum_value
from mesh_runtime.errors import error_info
from mesh_runtime.server import PortInUse
from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, observability_pb2, registry_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc, routing_pb2
from rollmesh.replica.v1 import replica_agent_pb2, replica_agent_pb2_grpc
from tests.processes import clean_env

pytestmark = pytest.mark.timeout(60)

MODULES = {"controller": controller.server, "lb": loadbalancer.server, "replica-agent": replica_agent.server,
           "trainer-agent": trainer_agent.server}
GARBAGE = b"\xff\xff\xff\xff"        # wire type 7 does not exist: no message parses from it


def _config(module, **overrides):
    return load_config(module.CONFIG_CLASS, None, overrides={"listen": "127.0.0.1:0", **overrides})


@pytest.fixture
async def served(request):
    module = MODULES[request.param]
    server, port = await module.SPEC.create(_config(module))
    try:
        yield module, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@pytest.mark.parametrize("served", list(MODULES), indirect=True)
async def test_undecodable_bytes_are_invalid_argument_on_every_server(served):
    module, address = served
    service = module.SPEC.descriptor.full_name
    async with grpc.aio.insecure_channel(address) as channel:
        for method in module.SPEC.descriptor.methods:
            if method.client_streaming or method.server_streaming:
                continue
            call = channel.unary_unary(f"/{service}/{method.name}")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(GARBAGE, timeout=5)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (method.name, info.value.details())
            assert f"is not a valid {method.input_type.full_name}" in info.value.details()
            assert error_info(info.value).reason == "MALFORMED_REQUEST"


@pytest.mark.parametrize("served", ["controller"], indirect=True)
async def test_streams_reject_undecodable_messages_too(served):
    _, address = served
    async with grpc.aio.insecure_channel(address) as channel:
        watch = channel.unary_stream("/rollmesh.controller.v1.ControllerService/WatchEvents")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in watch(GARBAGE, timeout=5):
                pass
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        reports = channel.stream_stream("/rollmesh.controller.v1.ControllerService/StreamLoadReports")

        async def one_bad():
            yield GARBAGE
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in reports(one_bad(), timeout=5):
                pass
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


@pytest.mark.parametrize("served", ["lb"], indirect=True)
async def test_unknown_enum_value_in_a_nested_repeated_message_is_invalid_argument(served):
    _, address = served
    async with grpc.aio.insecure_channel(address) as channel:
        stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
        bad = routing_pb2.ReplicaEndpoint(replica_id="r1", address="127.0.0.1:1", kind=99)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.AddReplicas(loadbalancer_pb2.AddReplicasRequest(replicas=[bad]), timeout=5)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "replicas[0].kind: 99 is not a value of rollmesh.common.v1.ReplicaKind" in info.value.details()
        assert error_info(info.value).reason == "UNKNOWN_ENUM_VALUE"
        listed = await stub.ListReplicas(loadbalancer_pb2.ListReplicasRequest(), timeout=5)
        assert list(listed.replicas) == []                      # nothing changed


@pytest.mark.parametrize("served", ["controller"], indirect=True)
async def test_unknown_event_type_in_watch_events_is_invalid_argument(served):
    _, address = served
    async with grpc.aio.insecure_channel(address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.WatchEvents(observability_pb2.WatchEventsRequest(types=[999]), timeout=5):
                pass
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "types[0]: 999 is not a value of rollmesh.controller.v1.EventType" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListReplicas(registry_pb2.ListReplicasRequest(kinds=[1], states=[1, 77]), timeout=5)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "states[1]: 77 is not a value of rollmesh.common.v1.ReplicaState" in info.value.details()


@pytest.mark.parametrize("served", ["replica-agent"], indirect=True)
async def test_unknown_replica_kind_in_launch_replica_is_invalid_argument(served):
    _, address = served
    async with grpc.aio.insecure_channel(address) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.LaunchReplica(replica_agent_pb2.LaunchReplicaRequest(replica_id="x", kind=99), timeout=5)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "kind: 99 is not a value of rollmesh.common.v1.ReplicaKind" in info.value.details()


def test_the_enum_walk_covers_maps_and_accepts_known_values():
    ok = routing_pb2.ReplicaEndpoint(replica_id="r", kind=types_pb2.REPLICA_KIND_HYBRID)
    assert unknown_enum_value(loadbalancer_pb2.AddReplicasRequest(replicas=[ok])) is None
    assert unknown_enum_value(observability_pb2.WatchEventsRequest(types=[1, 2])) is None


async def test_a_second_server_on_the_same_port_is_refused():
    first, port = await loadbalancer.server.SPEC.create(_config(loadbalancer.server))
    try:
        with pytest.raises(PortInUse, match=f"cannot listen on 127.0.0.1:{port}: the address is in use"):
            await loadbalancer.server.SPEC.create(_config(loadbalancer.server, listen=f"127.0.0.1:{port}"))
    finally:
        await first.stop(0)


def test_a_port_in_use_exits_2_naming_the_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "launcher.cli", "lb", "--listen", f"127.0.0.1:{port}"],
                                capture_output=True, text=True, timeout=60, env=clean_env())
    assert result.returncode == 2, result.stderr
    assert f"rollmesh lb: error: cannot listen on 127.0.0.1:{port}" in result.stderr
