"""The one channel factory: every package's channels come from it, and its retry policy retries reads only."""

from __future__ import annotations

import ast
from pathlib import Path

import grpc
import pytest

from mesh_runtime.channels import effect_free_methods, open_channel, open_sync_channel, read_methods
from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc, registry_pb2

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mesh_runtime", "controller", "loadbalancer", "replica_agent", "trainer_agent", "launcher",
            "simulator", "weight_transfer", "modeling")
FACTORY = ROOT / "mesh_runtime" / "channels.py"
RAW = {"insecure_channel", "secure_channel"}


def test_every_channel_of_the_packages_comes_from_the_factory():
    offenders = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path == FACTORY:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in RAW:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.attr}")
    assert offenders == [], "open channels with mesh_runtime.channels.open_channel / open_sync_channel"


def test_read_methods_are_the_unary_gets_and_lists_of_every_service():
    methods = read_methods()
    services = {service for service, _ in methods}
    assert services == {"rollmesh.controller.v1.ControllerService", "rollmesh.loadbalancer.v1.LoadBalancerService",
                        "rollmesh.replica.v1.ReplicaAgentService", "rollmesh.trainer.v1.TrainerAgentService",
                        "google.longrunning.Operations"}   # the controller's scale operations
    assert ("google.longrunning.Operations", "GetOperation") in methods
    assert ("rollmesh.controller.v1.ControllerService", "GetStatus") in methods
    assert ("rollmesh.controller.v1.ControllerService", "ListReplicas") in methods
    assert all(name.startswith(("Get", "List")) for _, name in methods)
    assert not any(name == "WatchEvents" for _, name in methods)    # a stream is never retried by the channel


class _Flaky(controller_pb2_grpc.ControllerServiceServicer):
    """Answers UNAVAILABLE to the first two calls of each method, then succeeds."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    async def _flaky(self, name: str, context, reply):
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.calls[name] <= 2:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        return reply

    async def GetStatus(self, request, context):
        return await self._flaky("GetStatus", context, controller_pb2.GetStatusResponse())

    async def RegisterNode(self, request, context):
        return await self._flaky("RegisterNode", context, registry_pb2.RegisterNodeResponse())


@pytest.fixture
async def flaky_server():
    server = grpc.aio.server()
    servicer = _Flaky()
    controller_pb2_grpc.add_ControllerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", servicer
    await server.stop(None)


async def test_reads_are_retried_on_unavailable_and_writes_are_not(flaky_server):
    address, servicer = flaky_server
    async with open_channel(address, idempotent=read_methods()) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        await stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=10)
        assert servicer.calls["GetStatus"] == 3                      # two UNAVAILABLE, retried by the channel
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(), timeout=10)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE and servicer.calls["RegisterNode"] == 1


async def test_without_idempotent_methods_nothing_is_retried(flaky_server):
    address, servicer = flaky_server
    async with open_channel(address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=10)
        assert servicer.calls["GetStatus"] == 1


async def test_the_sync_channel_has_the_same_retry_policy(flaky_server):
    import asyncio

    address, servicer = flaky_server

    def call() -> None:
        with open_sync_channel(address, idempotent=read_methods()) as channel:
            controller_pb2_grpc.ControllerServiceStub(channel).GetStatus(controller_pb2.GetStatusRequest(), timeout=10)

    await asyncio.to_thread(call)                                    # blocking client, server on this loop
    assert servicer.calls["GetStatus"] == 3


def test_the_hash_ring_keeps_an_id_on_one_balancer_and_skips_a_dead_one():
    import grpc

    from mesh_runtime.hash_ring import HashRingChannel

    ring = HashRingChannel(["a:1", "b:1", "c:1"], open_one=lambda address: None)
    first = {f"id-{i}": ring.order(f"id-{i}") for i in range(3000)}
    assert all(ring.order(k) == v for k, v in first.items())   # the same id, the same balancer
    assert all(sorted(v) == ["a:1", "b:1", "c:1"] for v in first.values())
    spread = {a: sum(1 for v in first.values() if v[0] == a) for a in ("a:1", "b:1", "c:1")}
    assert min(spread.values()) > 700, spread

    class Dead(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "failed to connect to all addresses"

        def trailing_metadata(self):
            return ()
    assert ring.observe(Dead(), "a:1")
    for key, order in first.items():   # a's ids go to their next balancer in the ring; the others stay put
        now = ring.order(key)
        assert now[-1] == "a:1" and now[:2] == [x for x in order if x != "a:1"]


class _Lost(controller_pb2_grpc.ControllerServiceServicer):
    """Every call is lost after it arrived (UNAVAILABLE without ErrorInfo, as when the server dies mid-call)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def GetStatus(self, request, context):
        self.calls.append("GetStatus")
        await context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)")

    async def RegisterNode(self, request, context):
        self.calls.append("RegisterNode")
        await context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)")


class _Fine(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def GetStatus(self, request, context):
        self.calls.append("GetStatus")
        return controller_pb2.GetStatusResponse(last_event_sequence=7)

    async def RegisterNode(self, request, context):
        self.calls.append("RegisterNode")
        return registry_pb2.RegisterNodeResponse()


async def test_a_following_channel_resends_a_lost_read_elsewhere_but_never_a_lost_write():
    servers, servicers, addresses = [], [_Lost(), _Fine()], []
    for servicer in servicers:
        server = grpc.aio.server()
        controller_pb2_grpc.add_ControllerServiceServicer_to_server(servicer, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    lost, fine = servicers
    try:
        async with open_channel(",".join(addresses)) as channel:     # no idempotent methods named
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.RegisterNode(registry_pb2.RegisterNodeRequest(), timeout=10)
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE      # its effect is unknown: the caller's
            assert (lost.calls, fine.calls) == (["RegisterNode"], [])
        async with open_channel(",".join(addresses)) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            reply = await stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=10)
            assert reply.last_event_sequence == 7                         # a read: resent to the next address
            assert (lost.calls, fine.calls) == (["RegisterNode", "GetStatus"], ["GetStatus"])
    finally:
        for server in servers:
            await server.stop(None)
    assert "/google.longrunning.Operations/WaitOperation" in effect_free_methods()
    assert "/rollmesh.controller.v1.ControllerService/RegisterNode" not in effect_free_methods()
