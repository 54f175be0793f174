"""The load-report stream tells the agent when its lease expires (the fleet-scale issue: documented, never set)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

import controller.server
from mesh_runtime.config import load_config
from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2

pytestmark = pytest.mark.timeout(60)


async def test_the_reply_carries_lease_expires_at_one_ttl_after_the_report():
    config = load_config(controller.server.CONFIG_CLASS, None, overrides={"listen": "127.0.0.1:0",
                                                                          "lease_ttl_s": 30.0})
    server, port = await controller.server.SPEC.create(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(
                node_id="n1", address="127.0.0.1:5999", slots_total=1, replicas=[registry_pb2.ReplicaRegistration(
                    replica_id="r1", kind=types_pb2.REPLICA_KIND_STANDALONE, state=types_pb2.REPLICA_STATE_ACTIVE,
                    slots=[0])]), timeout=5)

            async def reports():
                yield registry_pb2.StreamLoadReportsRequest(node_id="n1")

            sent = time.time()
            call = stub.StreamLoadReports(reports(), timeout=10)
            reply = await call.read()
            call.cancel()
            await asyncio.sleep(0.5)
            call = stub.StreamLoadReports(reports(), timeout=10)   # a later report moves the lease on
            later = await call.read()
            call.cancel()
        expires = reply.lease_expires_at.ToNanoseconds() / 1e9
        assert later.lease_expires_at.ToNanoseconds() / 1e9 >= expires + 0.4
        assert sent + 29 <= expires <= time.time() + 30.5
        assert reply.lease_ttl.ToNanoseconds() == 30 * 10**9
    finally:
        await server.stop(0)
