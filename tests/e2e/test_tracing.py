"""A call that crosses two server processes yields one trace with correct parent links."""

from __future__ import annotations

import grpc
import pytest

from launcher.processes import start_server
from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc
from tests.otlp_receiver import start_receiver
from tests.processes import clean_env

pytestmark = [pytest.mark.timeout(120)]

SERVER = 2  # opentelemetry.proto Span.SpanKind.SPAN_KIND_SERVER
CLIENT = 3


def _env(**extra: str) -> dict[str, str]:
    return clean_env(**extra)


async def test_status_fan_out_is_one_trace_across_controller_and_lb(tmp_path):
    receiver_server, receiver, port = await start_receiver()
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100"}
    lb = await start_server("lb", ["--listen", "127.0.0.1:0"], env=_env(**otel), log_path=tmp_path / "lb.log")
    controller = await start_server(
        "controller", ["--listen", "127.0.0.1:0"], log_path=tmp_path / "controller.log",
        env=_env(**otel, ROLLMESH_CONTROLLER__LOAD_BALANCER_ADDRESS=lb.address))
    try:
        async with grpc.aio.insecure_channel(controller.address) as channel:
            reply = await controller_pb2_grpc.ControllerServiceStub(channel).GetStatus(
                controller_pb2.GetStatusRequest(), timeout=10)
        assert [(p.role, p.address, p.reachable) for p in reply.peers] == [("lb", lb.address, True)]
        assert reply.peers[0].status.server_name == "lb"

        def complete(spans) -> bool:
            names = {(s.service, s.kind, s.name) for s in spans}
            return {("rollmesh-controller", SERVER, "rollmesh.controller.v1.ControllerService/GetStatus"),
                    ("rollmesh-controller", CLIENT, "rollmesh.loadbalancer.v1.LoadBalancerService/GetStatus"),
                    ("rollmesh-lb", SERVER, "rollmesh.loadbalancer.v1.LoadBalancerService/GetStatus")} <= names

        await receiver.wait_for(complete)
    finally:
        await controller.terminate()
        await lb.terminate()
        await receiver_server.stop(None)

    spans = receiver.spans
    # by name: the controller's routing reconciliation calls the balancer too (its first round runs at start)
    ctl_server = next(s for s in spans if s.service == "rollmesh-controller" and s.kind == SERVER
                      and s.name == "rollmesh.controller.v1.ControllerService/GetStatus")
    ctl_client = next(s for s in spans if s.service == "rollmesh-controller" and s.kind == CLIENT
                      and s.name == "rollmesh.loadbalancer.v1.LoadBalancerService/GetStatus")
    lb_server = next(s for s in spans if s.service == "rollmesh-lb" and s.kind == SERVER
                     and s.name == "rollmesh.loadbalancer.v1.LoadBalancerService/GetStatus")
    assert ctl_server.trace_id == ctl_client.trace_id == lb_server.trace_id
    assert ctl_client.parent_span_id == ctl_server.span_id
    assert lb_server.parent_span_id == ctl_client.span_id
    # Current semantic-convention names: rpc.*, network.peer.* on the server, server.* on the client.
    assert ctl_client.attributes["server.port"] == int(lb.address.rsplit(":", 1)[1])
    assert ctl_client.attributes["server.address"] == "127.0.0.1"
    assert lb_server.attributes["network.peer.address"] == "127.0.0.1"
    assert lb_server.attributes["network.type"] == "ipv4" and lb_server.attributes["network.transport"] == "tcp"
    for span in (ctl_server, ctl_client, lb_server):
        assert span.attributes["rpc.system"] == "grpc" and span.attributes["rpc.method"] == "GetStatus"
        assert span.attributes["rpc.grpc.status_code"] == 0
        assert not [key for key in span.attributes if key.startswith("net.")]
    # Health checks and reflection are never traced.
    assert not [s for s in spans if "grpc.health" in s.name or "reflection" in s.name]
