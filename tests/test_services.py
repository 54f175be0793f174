"""Component tests of the four servers in-process (grpc.aio on port 0)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import controller.server
import loadbalancer.server
import replica_agent.server
import trainer_agent.server
from mesh_runtime.capabilities import unaccounted_methods
from mesh_runtime.config import load_config
from mesh_runtime.errors import FailedPrecondition, InvalidArgument, error_info
from rollmesh.controller.v1 import controller_pb2_grpc
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc
from rollmesh.replica.v1 import replica_agent_pb2_grpc
from rollmesh.trainer.v1 import trainer_agent_pb2_grpc

pytestmark = pytest.mark.timeout(60)

SERVERS = {
    "controller": (controller.server, controller_pb2_grpc.ControllerServiceServicer),
    "lb": (loadbalancer.server, loadbalancer_pb2_grpc.LoadBalancerServiceServicer),
    "replica-agent": (replica_agent.server, replica_agent_pb2_grpc.ReplicaAgentServiceServicer),
    "trainer-agent": (trainer_agent.server, trainer_agent_pb2_grpc.TrainerAgentServiceServicer),
}


def _config(module):
    return load_config(module.CONFIG_CLASS, None, overrides={"listen": "127.0.0.1:0"})


@pytest.mark.parametrize("name", list(SERVERS))
def test_every_rpc_of_the_contract_is_implemented(name):
    module, base = SERVERS[name]
    servicer = module.SPEC.make_servicer(_config(module), None)
    assert unaccounted_methods(servicer, base, module.SPEC.descriptor) == []


def test_an_rpc_left_to_the_generated_base_is_reported():
    module, base = SERVERS["lb"]
    servicer = module.SPEC.make_servicer(_config(module), None)
    partial = type("Partial", (base,), {"GetStatus": type(servicer).GetStatus})()
    missing = unaccounted_methods(partial, base, module.SPEC.descriptor)
    assert "GetStatus" not in missing
    assert set(missing) == {m.name for m in module.SPEC.descriptor.methods} - {"GetStatus"}


async def test_health_goes_not_serving_on_shutdown_and_stop_is_idempotent():
    server, port = await loadbalancer.server.create_server(_config(loadbalancer.server))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        stopping = server.stop(1.0)
        await stopping
        await server.stop(1.0)  # a second stop is a no-op
        assert server.ready is False


class _FailingServicer(loadbalancer_pb2_grpc.LoadBalancerServiceServicer):
    """Raises domain and stray errors so the mapping can be checked end to end."""

    def __init__(self, config) -> None:
        from mesh_runtime.status import StatusReporter

        self.status = StatusReporter(config, ["status"])
        self.calls = 0

    async def GetStatus(self, request, context):  # noqa: N802
        self.calls += 1
        if self.calls == 1:
            raise InvalidArgument("replica_id must not be empty", reason="EMPTY_REPLICA_ID",
                                  metadata={"field": "replica_id"})
        if self.calls == 2:
            raise FailedPrecondition("expected CompleteTrainingStep first")
        raise KeyError("boom")

    async def Generate(self, request, context):  # noqa: N802
        yield loadbalancer_pb2.GenerateResponse(request_id="partial")
        raise InvalidArgument("bad stream")


async def test_domain_errors_map_to_canonical_status_with_error_info():
    spec = dataclasses.replace(loadbalancer.server.SPEC, make_servicer=lambda c, t: _FailingServicer(c))
    server, port = await spec.create(_config(loadbalancer.server))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
            expected = [(grpc.StatusCode.INVALID_ARGUMENT, "EMPTY_REPLICA_ID"),
                        (grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION"),
                        (grpc.StatusCode.INTERNAL, "INTERNAL")]
            for code, reason in expected:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.GetStatus(loadbalancer_pb2.GetStatusRequest(), timeout=5)
                assert info.value.code() == code
                assert error_info(info.value).reason == reason
            call = stub.Generate(loadbalancer_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1]), timeout=5)
            first = await call.read()
            assert first.request_id == "partial"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == "bad stream"
    finally:
        await server.stop(0)
