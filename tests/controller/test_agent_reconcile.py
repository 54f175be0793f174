"""Level-triggered reconciliation with the replica agents, through their load reports.

A load-report message lists every replica its agent hosts. A replica the
controller holds live but the agent stopped reporting is failed (and so leaves
routing); a replica the agent reports but the controller does not hold, or
holds failed, makes the controller ask the agent to register again.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

import controller.server
from mesh_runtime.config import load_config
from rollmesh.common.v1 import load_pb2, types_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2

pytestmark = pytest.mark.timeout(60)


def _replica(replica_id: str, slot: int) -> registry_pb2.ReplicaRegistration:
    return registry_pb2.ReplicaRegistration(replica_id=replica_id, kind=types_pb2.REPLICA_KIND_STANDALONE,
                                            state=types_pb2.REPLICA_STATE_ACTIVE, slots=[slot])


async def _state(stub, replica_id: str) -> int:
    return (await stub.GetReplica(registry_pb2.GetReplicaRequest(replica_id=replica_id))).replica.state


async def test_replicas_the_agent_stops_reporting_fail_and_unknown_ones_ask_for_a_registration():
    config = load_config(controller.server.CONFIG_CLASS, None, overrides={"listen": "127.0.0.1:0",
                                                                          "lease_ttl_s": 30.0})
    server, port = await controller.server.SPEC.create(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(
                node_id="n1", address="127.0.0.1:5999", slots_total=2, replicas=[_replica("r1", 0), _replica("r2", 1)]),
                timeout=5)
            outbox: asyncio.Queue = asyncio.Queue()

            async def messages():
                while True:
                    yield await outbox.get()

            call = stub.StreamLoadReports(messages(), timeout=30)

            def report(*ids: str) -> registry_pb2.StreamLoadReportsRequest:
                return registry_pb2.StreamLoadReportsRequest(
                    node_id="n1", reports=[load_pb2.LoadReport(replica_id=i) for i in ids])

            await outbox.put(report("r1", "r2"))
            first = await call.read()
            assert not first.register_again
            await outbox.put(report("r1"))          # r2 missing once: could be a report racing a launch
            await asyncio.sleep(0.3)
            assert await _state(stub, "r2") == types_pb2.REPLICA_STATE_ACTIVE
            await outbox.put(report("r1"))          # twice in a row: the agent no longer hosts it
            await asyncio.sleep(0.3)
            r2 = (await stub.GetReplica(registry_pb2.GetReplicaRequest(replica_id="r2"))).replica
            assert r2.state == types_pb2.REPLICA_STATE_FAILED
            assert await _state(stub, "r1") == types_pb2.REPLICA_STATE_ACTIVE

            await outbox.put(report("r1", "r9"))    # r9: the controller never heard of it
            again = await asyncio.wait_for(call.read(), 5)
            assert again.register_again
            await outbox.put(report("r1", "r2"))    # r2 is back on the agent, but the controller failed it
            assert (await asyncio.wait_for(call.read(), 5)).register_again
            call.cancel()
            # the agent registers again with what it hosts: adopted as reported
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(
                node_id="n1", address="127.0.0.1:5999", slots_total=2, replicas=[_replica("r1", 0), _replica("r2", 1)]),
                timeout=5)
            assert await _state(stub, "r2") == types_pb2.REPLICA_STATE_ACTIVE
    finally:
        await server.stop(0)


async def test_a_stopped_replica_in_the_reports_changes_nothing():
    # an agent keeps reporting a replica it stopped (e.g. one the controller rejected) for a while:
    # that is not drift, and must not loop the agent through registrations
    config = load_config(controller.server.CONFIG_CLASS, None, overrides={"listen": "127.0.0.1:0",
                                                                          "lease_ttl_s": 30.0})
    server, port = await controller.server.SPEC.create(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(
                node_id="n1", address="127.0.0.1:5999", slots_total=2, replicas=[_replica("r1", 0)]), timeout=5)

            async def messages():
                for _ in range(3):
                    yield registry_pb2.StreamLoadReportsRequest(node_id="n1", reports=[
                        load_pb2.LoadReport(replica_id="r1", state=types_pb2.REPLICA_STATE_ACTIVE),
                        load_pb2.LoadReport(replica_id="gone", state=types_pb2.REPLICA_STATE_STOPPED)])
                    await asyncio.sleep(0.1)

            replies = [reply async for reply in stub.StreamLoadReports(messages(), timeout=10)]
            assert len(replies) == 1 and not replies[0].register_again
            assert await _state(stub, "r1") == types_pb2.REPLICA_STATE_ACTIVE
    finally:
        await server.stop(0)
