"""``rollmesh lb --workers 2`` (real processes): two balancer processes, each registered as <id>-w<i> and
filled by the controller; a client reading the set spreads requests over both; a worker killed with
SIGKILL is started again and registers again; SIGTERM to the parent stops both, and both deregister."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import pytest

from rollmesh.common.v1 import generation_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, events_pb2, registry_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2
from trainer_client import MeshClient
from tests.controller.scaling.helpers import Procs, events_of, lb_stub, routed, until

pytestmark = pytest.mark.timeout(240)
CONTROLLER = """state_dir: {state}
lease_ttl_s: 2
reconcile_interval_s: 0.5
"""


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def test_two_workers_register_share_the_requests_come_back_and_stop_together(tmp_path):
    procs = Procs(tmp_path)
    try:
        ctl_address = procs.start("controller", "controller", CONTROLLER.format(state=tmp_path / "state"))
        procs.start("lb", "lb", f"controller_address: {ctl_address}\nbalancer_id: lb\nworkers: 2\n")
        procs.agent("a", controller=ctl_address, slots=1, tps=2000)
        parent = procs.procs["lb"][1]
        async with grpc.aio.insecure_channel(ctl_address) as channel:
            ctl = controller_pb2_grpc.ControllerServiceStub(channel)

            async def ready() -> dict[str, str]:
                reply = await ctl.ListBalancers(registry_pb2.ListBalancersRequest(ready_only=True))
                return {b.balancer_id: b.address for b in reply.balancers}

            async def both_ready():
                return sorted(await ready()) == ["lb-w0", "lb-w1"]
            await until(both_ready, 60, what="both workers registered and ready")
            workers = await ready()
            assert len(set(workers.values())) == 2
            for address in workers.values():   # the controller fills each worker's table
                async with grpc.aio.insecure_channel(address) as c:
                    async def filled(c=c):
                        return await routed(lb_stub(c)) == ["a-s0"]
                    await until(filled, 30, what=f"the replica routed by {address}")

            async with MeshClient(ctl_address) as mesh:
                ring = await mesh.generation_channel()
                try:
                    for i in range(40):
                        final = await mesh.generate(ring, loadbalancer_pb2.GenerateRequest(
                            request_id=f"w-{i}", prompt_token_ids=[1, 2],
                            sampling_params=generation_pb2.SamplingParams(max_tokens=4, ignore_eos=True)))
                        assert len(final.token_ids) == 4
                finally:
                    await ring.close()
            for address in workers.values():   # the consistent hash sent some to each
                async with grpc.aio.insecure_channel(address) as c:
                    stats = await lb_stub(c).GetStats(loadbalancer_pb2.GetStatsRequest())
                    assert stats.stats.requests_total > 0

            first = children(parent.pid)
            assert len(first) == 2
            os.kill(first[0], signal.SIGKILL)

            async def replaced():
                now = children(parent.pid)
                return len(now) == 2 and first[0] not in now and sorted(await ready()) == ["lb-w0", "lb-w1"]
            await until(replaced, 60, what="the killed worker started again and ready")

            parent.send_signal(signal.SIGTERM)
            assert parent.wait(timeout=60) == 0
            gone = await events_of(ctl, events_pb2.EVENT_TYPE_BALANCER_DEREGISTERED)
            assert sorted(e.attributes["balancer_id"] for e in gone) == ["lb-w0", "lb-w1"]
    finally:
        procs.close()
