"""The leading controller of an etcd store is killed (SIGKILL) in the middle of scale operations; a standby
takes over and applies the same restart rules as a controller restarted on its disk.

A scale-out caught mid-way is rolled back and ends FAILED "controller
restarted" (nothing it connected stays in the mesh); a scale-in caught while
draining resumes on the new leader and completes, its in-flight requests
finish (0 lost), and the removed replica is stopped on its agent. The agent
and the operator's client are given every controller's address and follow the
leader by themselves.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

import pytest

from mesh_runtime.channels import open_channel
from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import controller_pb2, scaling_pb2
from tests.controller.scaling.helpers import (
    Procs, agent_states, black_hole, controller_stub, finished, generate, get_op, in_flight, in_state, lb_stub,
    replicas, routed, scale_in, scale_out, until)
from tests.etcd_server import etcd_cluster, needs_etcd
from tests.processes import free_port

pytestmark = [needs_etcd, pytest.mark.timeout(300)]
CONTROLLER = """load_balancer_address: {lb}
lease_ttl_s: 5
load_report_interval_s: 0.2
store: {store}
store_lease_ttl_s: 2
standby_refresh_s: 0.5
node_id: {name}
scale_in_drain_timeout: 120
async_training: {{port_timeout_s: 30}}
"""


async def test_scale_operations_survive_a_kill_of_the_leader(tmp_path):
    procs = Procs(tmp_path)
    hole, hole_address = await black_hole()
    try:
        with etcd_cluster(tmp_path / "etcd") as etcd:
            store = etcd.url("/scaling")
            lb = procs.start("lb", "lb", "")
            first, second, third = (f"127.0.0.1:{free_port()}" for _ in range(3))
            everyone = f"{first},{second},{third}"   # what the agent and the client are configured with
            procs.start("first", "controller", CONTROLLER.format(lb=lb, store=store, name="first"), listen=first)
            procs.start("second", "controller", CONTROLLER.format(lb=lb, store=store, name="second"), listen=second)
            agent = procs.agent("a", controller=everyone, slots=3)
            e1 = procs.agent("e1", slots=1)
            async with open_channel(lb) as lch, open_channel(everyone) as cch:
                bal, ctl = lb_stub(lch), controller_stub(cch)

                async def routed_is(expected):
                    return await routed(bal) == expected
                await until(lambda: routed_is(["a-s0"]))
                grown = await finished(ctl, (await scale_out(ctl, num_replicas=2)).operation_id)
                assert grown.state == scaling_pb2.OPERATION_STATE_ACTIVE, grown
                added = grown.replica_ids[0]
                stuck = await scale_out(ctl, engine_addresses=[e1, hole_address])
                await in_state(ctl, stuck.operation_id, scaling_pb2.OPERATION_STATE_CONNECTING)

                async def adopted():
                    return "e1-s0" in await replicas(ctl)
                await until(adopted)
                procs.kill("first")   # the leader, mid scale-out: the standby takes over within the 2 s lease
                failed = await finished(ctl, stuck.operation_id)
                assert failed.state == scaling_pb2.OPERATION_STATE_FAILED
                assert "controller restarted" in failed.error_message
                assert "e1-s0" not in await replicas(ctl)
                assert (await get_op(ctl, grown.operation_id)).state == scaling_pb2.OPERATION_STATE_ACTIVE
                status = await ctl.GetStatus(controller_pb2.GetStatusRequest(), timeout=10)
                assert status.role == controller_pb2.CONTROLLER_ROLE_LEADER and status.leader_address == second
                await until(lambda: routed_is(sorted(["a-s0", added])))

                # a standby again (the killed one restarted), then the new leader is killed while a scale-in drains
                procs.start("third", "controller", CONTROLLER.format(lb=lb, store=store, name="third"), listen=third)
                runs = [asyncio.create_task(generate(bal, f"r{i}", 300)) for i in range(8)]

                async def busy():
                    return await in_flight(bal, added) > 0
                await until(busy)
                shrink = await scale_in(ctl, num_replicas=1)
                assert list(shrink.replica_ids) == [added]
                await in_state(ctl, shrink.operation_id, scaling_pb2.OPERATION_STATE_DRAINING)
                async with open_channel(third) as standby:   # its copy is the store's: DRAINING is durable
                    async def stored_draining():
                        with contextlib.suppress(grpc.aio.AioRpcError):   # NOT_FOUND until it is stored
                            op = await get_op(controller_stub(standby), shrink.operation_id)
                            return op.state == scaling_pb2.OPERATION_STATE_DRAINING
                        return False
                    await until(stored_draining)
                procs.kill("second")
                following = open_channel(everyone)
                ctl = controller_stub(following)
                done = await finished(ctl, shrink.operation_id)
                assert done.state == scaling_pb2.OPERATION_STATE_COMPLETED, done.error_message
                assert "resumed after controller restart" in done.state_history[-1].reason
                finals = await asyncio.gather(*runs)
                assert all(f.usage.completion_tokens == 300 for f in finals)   # 0 requests lost
                assert await routed(bal) == ["a-s0"]
                assert (await agent_states(agent))[added] == types_pb2.REPLICA_STATE_STOPPED
                status = await ctl.GetStatus(controller_pb2.GetStatusRequest(), timeout=10)
                assert status.leader_address == third
                await following.close()
    finally:
        hole.close()
        procs.close()
