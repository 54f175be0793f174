"""Graceful under a registration storm: admission with RetryInfo, no work for a caller that gave up, a pace
that grows with the fleet, and agents that wait as long as they are told."""

from __future__ import annotations

import asyncio
import time
import types

import grpc
import pytest

from controller.core.admission import Admission
from controller.server import SPEC
from mesh_runtime.config import load_config
from mesh_runtime.errors import DeadlineExceeded, ResourceExhausted, error_info, retry_delay, to_status
from mesh_runtime.pipeline import ServerPipeline
from replica_agent.controller_link import ControllerLink
from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2

pytestmark = pytest.mark.timeout(60)


def test_a_rate_below_one_still_admits_one_at_a_time():
    now = [0.0]
    admission = Admission(0.5, lambda: now[0])
    assert admission.admit() == 0.0 and admission.admit() == pytest.approx(2.0)
    now[0] += 2.0
    assert admission.admit() == 0.0


def test_admission_spreads_the_refused_over_their_own_slots():
    now = [100.0]
    admission = Admission(10, lambda: now[0])
    assert [admission.admit() for _ in range(10)] == [0.0] * 10          # a burst of the budget
    delays = [admission.admit() for _ in range(3)]
    assert delays == pytest.approx([0.1, 0.2, 0.3])                       # each its own slot, not all at once
    now[0] += 1.0
    assert admission.admit() == 0.0 and admission.refused == 3


async def start(tmp_path, **overrides):
    config = load_config(SPEC.config_class, None, overrides={"listen": "127.0.0.1:0", **overrides})
    server, port = await SPEC.create(config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, controller_pb2_grpc.ControllerServiceStub(channel)


def node(n: int) -> registry_pb2.RegisterNodeRequest:
    return registry_pb2.RegisterNodeRequest(node_id=f"n{n}", address=f"127.0.0.1:{30000 + n}", slots_total=1)


async def test_registrations_past_the_budget_are_refused_with_retry_info_and_change_nothing(tmp_path):
    # half a registration a second: the first is admitted, the next one only 2 s later (a margin for a busy box)
    server, channel, stub = await start(tmp_path, max_registrations_per_s=0.5)
    try:
        await stub.RegisterNode(node(0), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as first:
            await stub.RegisterNode(node(1), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RegisterNode(node(2), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_info(err.value).reason == "REGISTRATIONS_THROTTLED"
        assert 0 < retry_delay(first.value) < retry_delay(err.value) <= 6.0   # each refused one its own slot
        assert "retry in" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.GetNode(registry_pb2.GetNodeRequest(node_id="n2"), timeout=10)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        await asyncio.sleep(retry_delay(err.value))
        await stub.RegisterNode(node(2), timeout=10)                      # on time, it is admitted
    finally:
        await channel.close()
        await server.stop(0)


async def test_a_registration_that_arrives_after_its_deadline_registers_nothing(tmp_path):
    from controller.service import ControllerServicer

    config = load_config(SPEC.config_class, None, overrides={"listen": "127.0.0.1:0"})
    servicer = ControllerServicer(config, None)
    context = types.SimpleNamespace(time_remaining=lambda: -0.5, peer=lambda: "ipv4:127.0.0.1:5000")
    with pytest.raises(DeadlineExceeded, match="after its deadline"):
        await servicer.RegisterNode(node(1), context)
    assert servicer.api.registry.node_count() == 0


async def test_the_report_interval_and_lease_grow_with_the_fleet(tmp_path):
    server, channel, stub = await start(tmp_path, max_load_reports_per_s=10, lease_ttl_s=10,
                                        load_report_interval_s=1, max_registrations_per_s=1000)
    try:
        for n in range(30):
            reply = await stub.RegisterNode(node(n), timeout=10)
        assert reply.load_report_interval.ToMilliseconds() == 3000 and reply.lease_ttl.ToMilliseconds() == 30000

        async def one_report():
            yield registry_pb2.StreamLoadReportsRequest(node_id="n0")
        answers = [a async for a in stub.StreamLoadReports(one_report(), timeout=10)]
        assert answers[0].load_report_interval.ToMilliseconds() == 3000
        assert answers[0].lease_expires_at.ToSeconds() > time.time() + 25
    finally:
        await channel.close()
        await server.stop(0)


class ThrottlingController(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.attempts: list[float] = []

    async def RegisterNode(self, request, context):  # noqa: N802
        self.attempts.append(time.monotonic())
        if len(self.attempts) == 1:
            raise ResourceExhausted("busy", reason="REGISTRATIONS_THROTTLED", retry_delay_s=self.delay_s)
        return registry_pb2.RegisterNodeResponse(node_id=request.node_id)

    async def StreamLoadReports(self, request_iterator, context):  # noqa: N802
        async for _ in request_iterator:
            pass


async def test_an_agent_waits_as_long_as_retry_info_says():
    fake = ThrottlingController(delay_s=1.5)
    server = grpc.aio.server(interceptors=[ServerPipeline()])
    controller_pb2_grpc.add_ControllerServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    link = ControllerLink(channel=channel, registration=lambda: node(7), reports=list, max_backoff_s=0.05)
    task = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(link.registered.wait(), 20)
        gap = fake.attempts[1] - fake.attempts[0]
        assert gap >= 1.4   # its own backoff would have retried within 0.05 s
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await channel.close()
        await server.stop(0)


def test_retry_info_travels_in_the_status():
    status = to_status(ResourceExhausted("busy", retry_delay_s=0.25))
    assert any(key == "grpc-status-details-bin" for key, _ in status.trailing_metadata)


async def test_listings_come_in_pages_that_add_up_to_the_fleet(tmp_path):
    server, channel, stub = await start(tmp_path, max_registrations_per_s=1000)
    try:
        for n in range(25):
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(
                node_id=f"n{n:02d}", address=f"127.0.0.1:{30000 + n}", slots_total=2, replicas=[
                    registry_pb2.ReplicaRegistration(replica_id=f"n{n:02d}-r{i}", slots=[i],
                                                     kind=types_pb2.REPLICA_KIND_STANDALONE) for i in range(2)]),
                timeout=10)
        seen, token, pages = [], "", 0
        while True:
            reply = await stub.ListReplicas(registry_pb2.ListReplicasRequest(page_size=7, page_token=token))
            seen += [r.replica_id for r in reply.replicas]
            pages += 1
            token = reply.next_page_token
            if not token:
                break
        assert seen == sorted(f"n{n:02d}-r{i}" for n in range(25) for i in range(2)) and pages == 8
        nodes = await stub.ListNodes(registry_pb2.ListNodesRequest(page_size=10))
        rest = await stub.ListNodes(registry_pb2.ListNodesRequest(page_size=100, page_token=nodes.next_page_token))
        assert [n.node_id for n in [*nodes.nodes, *rest.nodes]] == [f"n{n:02d}" for n in range(25)]
        assert rest.next_page_token == ""
        everything = await stub.ListReplicas(registry_pb2.ListReplicasRequest())        # 0 = all, as before
        assert len(everything.replicas) == 50 and everything.next_page_token == ""
        first = await stub.ListReplicas(registry_pb2.ListReplicasRequest(page_size=5))
        for bad, why in ((registry_pb2.ListReplicasRequest(page_size=5, page_token=first.next_page_token,
                                                           node_id="n01"), "other filters"),
                         (registry_pb2.ListReplicasRequest(page_token="garbage!"), "not one this server gave out"),
                         (registry_pb2.ListReplicasRequest(page_size=-1), "page_size must be >= 0")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListReplicas(bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details()
    finally:
        await channel.close()
        await server.stop(0)


async def test_a_replica_without_a_kind_is_invalid_not_an_internal_error(tmp_path):
    server, channel, stub = await start(tmp_path)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(
                node_id="n", address="127.0.0.1:30000", slots_total=1,
                replicas=[registry_pb2.ReplicaRegistration(replica_id="r", slots=[0])]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kind" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListReplicas(registry_pb2.ListReplicasRequest(states=[0]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unset" in err.value.details()
        assert (await stub.ListNodes(registry_pb2.ListNodesRequest())).nodes == []
    finally:
        await channel.close()
        await server.stop(0)
