"""A real agent process registers with a (fake) controller, reports load, re-registers after a restart."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2
from tests.processes import running_server

pytestmark = pytest.mark.timeout(90)


class FakeController(controller_pb2_grpc.ControllerServiceServicer):
    """Records registrations and load reports; asks for reports every 0.1 s."""

    def __init__(self, reject: tuple[str, ...] = (), register_again_at: int | None = None) -> None:
        self.registrations: list[registry_pb2.RegisterNodeRequest] = []
        self.reports: list[registry_pb2.StreamLoadReportsRequest] = []
        self.reject = reject
        self.register_again_at = register_again_at
        self.changed = asyncio.Event()

    async def RegisterNode(self, request, context):  # noqa: N802
        self.registrations.append(request)
        self.changed.set()
        reply = registry_pb2.RegisterNodeResponse(node_id=request.node_id, rejected_replica_ids=self.reject)
        reply.load_report_interval.FromMilliseconds(100)
        reply.lease_ttl.FromSeconds(2)
        return reply

    async def StreamLoadReports(self, request_iterator, context):  # noqa: N802
        first = True
        async for message in request_iterator:
            self.reports.append(message)
            self.changed.set()
            if first:
                first = False
                reply = registry_pb2.StreamLoadReportsResponse()
                reply.load_report_interval.FromMilliseconds(100)
                yield reply
            if len(self.reports) == self.register_again_at:
                yield registry_pb2.StreamLoadReportsResponse(register_again=True)

    async def wait_until(self, predicate, timeout=30.0):
        async def loop():
            while not predicate():
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(loop(), timeout)


async def start_fake(port: int = 0, **kwargs):
    fake = FakeController(**kwargs)
    server = grpc.aio.server()
    controller_pb2_grpc.add_ControllerServiceServicer_to_server(fake, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, fake, bound


async def test_agent_registers_reports_and_reregisters_after_controller_restart(tmp_path):
    server, fake, port = await start_fake(reject=("gone",))
    (tmp_path / "agent.yaml").write_text(f"""
node_id: leased
slots: 3
backend: synthetic
controller_address: 127.0.0.1:{port}
replicas:
  - {{replica_id: s0, kind: STANDALONE}}
  - {{replica_id: h0, kind: HYBRID}}
  - {{replica_id: gone, kind: STANDALONE}}
""")
    with running_server("replica-agent", ["--config", str(tmp_path / "agent.yaml"), "--listen", "127.0.0.1:0"],
                        log_path=tmp_path / "agent.log") as (address, _):
        await fake.wait_until(lambda: len(fake.reports) >= 3)
        registration = fake.registrations[0]
        assert registration.node_id == "leased" and registration.address == address
        kinds = {r.replica_id: (r.kind, r.state, r.initial) for r in registration.replicas}
        assert kinds == {"s0": (types_pb2.REPLICA_KIND_STANDALONE, types_pb2.REPLICA_STATE_ACTIVE, True),
                         "h0": (types_pb2.REPLICA_KIND_HYBRID, types_pb2.REPLICA_STATE_SLEEPING, True),
                         "gone": (types_pb2.REPLICA_KIND_STANDALONE, types_pb2.REPLICA_STATE_ACTIVE, True)}
        # The controller rejected "gone" (intentionally removed): the agent stopped it.
        await fake.wait_until(lambda: any(r.replica_id == "gone" and r.state == types_pb2.REPLICA_STATE_STOPPED
                                          for m in fake.reports for r in m.reports))
        latest = fake.reports[-1]
        assert latest.node_id == "leased" and {r.replica_id for r in latest.reports} >= {"s0", "h0"}

        await server.stop(0)  # the controller restarts on the same address
        server, fake2, _ = await start_fake(port)
        try:
            await fake2.wait_until(lambda: fake2.registrations and len(fake2.reports) >= 2)
            assert fake2.registrations[0].node_id == "leased"
            assert "gone" not in {r.replica_id for r in fake2.registrations[0].replicas}
        finally:
            await server.stop(0)


async def test_agent_registers_again_when_the_controller_asks(tmp_path):
    server, fake, port = await start_fake(register_again_at=3)
    (tmp_path / "agent.yaml").write_text(f"""
node_id: asked
slots: 1
backend: synthetic
controller_address: 127.0.0.1:{port}
replicas: [{{replica_id: s0, kind: STANDALONE}}]
""")
    try:
        with running_server("replica-agent", ["--config", str(tmp_path / "agent.yaml"), "--listen", "127.0.0.1:0"],
                            log_path=tmp_path / "agent.log"):
            await fake.wait_until(lambda: len(fake.registrations) >= 2 and len(fake.reports) >= 5)
            assert [r.replicas[0].replica_id for r in fake.registrations[:2]] == ["s0", "s0"]
    finally:
        await server.stop(0)
