"""Balancers that register with the controller (real processes): the controller fills each one's table and
lists it to clients once ready; a client reading the set from the controller spreads 1,000 requests over
them; one balancer killed (SIGKILL) mid-load loses and duplicates nothing, its lease lapses and it leaves
the set; one stopped (SIGTERM) deregisters at once; the set survives a controller restart."""

from __future__ import annotations

import signal

import grpc
import pytest

from mesh_runtime.discovery import open_discovered_balancers
from mesh_runtime.errors import error_info
from rollmesh.common.v1 import generation_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, events_pb2, registry_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2
from trainer_client import MeshClient
from tests.controller.scaling.helpers import Procs, events_of, generate, lb_stub, routed, until
from tests.loadbalancer.under_load import requests_through_a_kill

pytestmark = pytest.mark.timeout(300)
CONTROLLER = """state_dir: {state}
lease_ttl_s: 2
load_report_interval_s: 0.2
reconcile_interval_s: 0.5
"""
BALANCER = """controller_address: {ctl}
balancer_id: {name}
"""
REQUESTS = 1000


async def listed(ctl, *, ready_only: bool = True) -> list[str]:
    reply = await ctl.ListBalancers(registry_pb2.ListBalancersRequest(ready_only=ready_only))
    return [b.balancer_id for b in reply.balancers]


async def test_registered_balancers_are_kept_in_line_listed_and_dropped_when_they_die(tmp_path):
    procs = Procs(tmp_path)
    try:
        ctl_address = procs.start("controller", "controller", CONTROLLER.format(state=tmp_path / "state"))
        lb1 = procs.start("lb1", "lb", BALANCER.format(ctl=ctl_address, name="lb-1"))
        lb2 = procs.start("lb2", "lb", BALANCER.format(ctl=ctl_address, name="lb-2"))
        for node in ("a", "b"):
            procs.agent(node, controller=ctl_address, slots=1, tps=2000)
        async with grpc.aio.insecure_channel(ctl_address) as channel:
            ctl = controller_pb2_grpc.ControllerServiceStub(channel)

            async def both_ready():
                return await listed(ctl) == ["lb-1", "lb-2"]
            await until(both_ready, 60, what="both registered balancers ready")
            for address in (lb1, lb2):   # the controller filled both tables though it was told of neither
                async with grpc.aio.insecure_channel(address) as c:
                    async def filled(c=c):
                        return await routed(lb_stub(c)) == ["a-s0", "b-s0"]
                    await until(filled, 30)
            records = (await ctl.ListBalancers(registry_pb2.ListBalancersRequest())).balancers
            assert {(r.balancer_id, r.address, r.configured, r.lease_held) for r in records} == \
                {("lb-1", lb1, False, True), ("lb-2", lb2, False, True)}

            # a bad registration is refused and changes nothing
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ctl.RegisterBalancer(registry_pb2.RegisterBalancerRequest(balancer_id="lb-3", address=lb1))
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert error_info(err.value).reason == "BALANCER_ADDRESS_TAKEN"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ctl.RegisterBalancer(registry_pb2.RegisterBalancerRequest(balancer_id="lb-3", address="nope"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert await listed(ctl, ready_only=False) == ["lb-1", "lb-2"]

            ring = await open_discovered_balancers(ctl_address, refresh_s=0.3, timeout_s=30)
            assert sorted(ring.addresses) == sorted([lb1, lb2])
            stub = lb_stub(ring)
            completed, attempts = await requests_through_a_kill(stub, lambda: procs.kill("lb1"), requests=REQUESTS)
            assert len(completed) == REQUESTS and set(completed.values()) == {1}   # 0 lost, 0 duplicated
            assert sum(attempts.values()) > REQUESTS   # some were caught on the killed balancer and resent

            async def only_lb2():
                return await listed(ctl, ready_only=False) == ["lb-2"] and ring.addresses == [lb2]
            await until(only_lb2, 30, what="the killed balancer dropped from the set and from the client's ring")
            lapsed = await events_of(ctl, events_pb2.EVENT_TYPE_BALANCER_LEASE_EXPIRED)
            assert [e.attributes["balancer_id"] for e in lapsed] == ["lb-1"]

            # a third balancer joins the set and the client's ring; stopped gracefully, it leaves at once
            lb3 = procs.start("lb3", "lb", BALANCER.format(ctl=ctl_address, name="lb-3"))

            async def three_in_ring():
                return sorted(ring.addresses) == sorted([lb2, lb3])
            await until(three_in_ring, 30, what="the new balancer in the client's ring")
            async with grpc.aio.insecure_channel(lb3) as c:
                assert await routed(lb_stub(c)) == ["a-s0", "b-s0"]   # ready means its table is filled
            async with MeshClient(ctl_address) as mesh:   # the Python client reads the same set
                assert [b.balancer_id for b in await mesh.balancers(ready_only=True)] == ["lb-2", "lb-3"]
                channel = await mesh.generation_channel()
                try:
                    for i in range(20):   # ids spread over both, each answered once
                        final = await generate(lb_stub(channel), f"client-{i}", 8)
                        assert final.usage.completion_tokens == 8
                    assert sorted(channel.addresses) == sorted([lb2, lb3])
                    # MeshClient.generate asks for the result only: one message holding every token
                    request = loadbalancer_pb2.GenerateRequest(   # streamed, it would come in 4 chunks of 2
                        request_id="client-final", prompt_token_ids=[1, 2, 3], stream_interval=2,
                        sampling_params=generation_pb2.SamplingParams(max_tokens=8, ignore_eos=True))
                    final = await mesh.generate(channel, request, timeout_s=30)
                    assert not request.final_only   # the caller's message is left as it was
                    assert len(final.token_ids) == 8 and final.usage.completion_tokens == 8
                    assert list(final.token_ids) == [t for seg in final.segments for t in seg.token_ids]
                    again = await generate(lb_stub(channel), "client-final", 8)   # the same record, streamed
                    assert list(again.token_ids) == list(final.token_ids)
                finally:
                    await channel.close()
            _, proc3 = procs.procs.pop("lb3")
            proc3.send_signal(signal.SIGTERM)
            proc3.wait(timeout=30)
            gone = await events_of(ctl, events_pb2.EVENT_TYPE_BALANCER_DEREGISTERED)
            assert [e.attributes["balancer_id"] for e in gone] == ["lb-3"]   # deregistered, not lapsed
            assert await listed(ctl, ready_only=False) == ["lb-2"]
            await ring.close()

        # the membership is durable: a restarted controller lists lb-2 as ready before any round
        procs.kill("controller")
        procs.start("controller2", "controller", CONTROLLER.format(state=tmp_path / "state"), listen=ctl_address)
        async with grpc.aio.insecure_channel(ctl_address) as channel:
            ctl = controller_pb2_grpc.ControllerServiceStub(channel)

            async def answers():
                try:
                    return await listed(ctl)
                except grpc.aio.AioRpcError:
                    return None
            assert await until(answers, 30) == ["lb-2"]
    finally:
        procs.close()
