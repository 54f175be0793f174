"""The controller is killed (SIGKILL) in the middle of scale operations and restarted on the same address.

Finished operations are still there; a scale-out caught mid-way is rolled back
and ends FAILED "controller restarted" (nothing it connected stays in the
mesh); a scale-in caught while draining resumes and completes, its in-flight
requests finish elsewhere, and the removed replica is stopped on its agent -
no replica is orphaned; the agent re-registers by itself.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import registry_pb2, scaling_pb2
from tests.controller.scaling.helpers import get_op, list_ops, scale_in, scale_out
from tests.controller.scaling.helpers import (
    Procs, agent_states, black_hole, controller_stub, finished, generate, in_flight, in_state, lb_stub, replicas,
    routed, until)

pytestmark = pytest.mark.timeout(300)
CONTROLLER = """load_balancer_address: {lb}
lease_ttl_s: 5
load_report_interval_s: 0.2
state_dir: {state}
scale_in_drain_timeout: 120
async_training: {{port_timeout_s: 30}}
"""


async def test_operations_survive_a_controller_kill_with_honest_states(tmp_path):
    procs = Procs(tmp_path)
    hole, hole_address = await black_hole()
    state = tmp_path / "state"
    try:
        lb = procs.start("lb", "lb", "")
        ctl_addr = procs.start("controller", "controller", CONTROLLER.format(lb=lb, state=state))
        agent = procs.agent("a", controller=ctl_addr, slots=3)
        e1 = procs.agent("e1", slots=1)
        async with grpc.aio.insecure_channel(lb) as lch:
            bal = lb_stub(lch)
            async with grpc.aio.insecure_channel(ctl_addr) as cch:
                ctl = controller_stub(cch)
                await until(lambda: _eq(routed(bal), ["a-s0"]))
                grown = await finished(ctl, (await scale_out(ctl, num_replicas=2)).operation_id)
                assert grown.state == scaling_pb2.OPERATION_STATE_ACTIVE
                added = grown.replica_ids[0]
                # An external scale-out hangs in CONNECTING on one address after adopting the other.
                stuck = await scale_out(ctl, engine_addresses=[e1, hole_address])
                await in_state(ctl, stuck.operation_id, scaling_pb2.OPERATION_STATE_CONNECTING)
                await until(lambda: _has(replicas(ctl), "e1-s0"))
            procs.kill("controller")
            ctl_addr = procs.start("controller2", "controller", CONTROLLER.format(lb=lb, state=state), listen=ctl_addr)
            async with grpc.aio.insecure_channel(ctl_addr) as cch:
                ctl = controller_stub(cch)
                failed = await finished(ctl, stuck.operation_id)
                assert failed.state == scaling_pb2.OPERATION_STATE_FAILED
                assert "controller restarted" in failed.error_message
                assert "e1-s0" not in await replicas(ctl)
                kept = await get_op(ctl, grown.operation_id)
                assert kept.state == scaling_pb2.OPERATION_STATE_ACTIVE
                assert await routed(bal) == sorted(["a-s0", added])

                # A scale-in is killed while draining long requests.
                runs = [asyncio.create_task(generate(bal, f"r{i}", 300)) for i in range(8)]
                await until(lambda: _positive(in_flight(bal, added)))
                shrink = await scale_in(ctl, num_replicas=1)
                assert list(shrink.replica_ids) == [added]
                await in_state(ctl, shrink.operation_id, scaling_pb2.OPERATION_STATE_DRAINING)
            procs.kill("controller2")
            ctl_addr = procs.start("controller3", "controller", CONTROLLER.format(lb=lb, state=state), listen=ctl_addr)
            async with grpc.aio.insecure_channel(ctl_addr) as cch:
                ctl = controller_stub(cch)
                done = await finished(ctl, shrink.operation_id)
                assert done.state == scaling_pb2.OPERATION_STATE_COMPLETED, done.error_message
                assert "resumed after controller restart" in done.state_history[-1].reason
                finals = await asyncio.gather(*runs)
                assert all(f.usage.completion_tokens == 300 for f in finals)
                assert await routed(bal) == ["a-s0"]
                states = await agent_states(agent)
                assert states[added] == types_pb2.REPLICA_STATE_STOPPED
                assert (await replicas(ctl))[added].intentionally_removed

                async def reregistered():
                    node = (await ctl.GetNode(registry_pb2.GetNodeRequest(node_id="a"))).node
                    return node.lease_held and node.last_report_at.seconds > 0
                await until(reregistered)
                listed = await list_ops(ctl)
                assert {o.operation_id: o.state for o in listed} == {
                    grown.operation_id: scaling_pb2.OPERATION_STATE_ACTIVE,
                    stuck.operation_id: scaling_pb2.OPERATION_STATE_FAILED,
                    shrink.operation_id: scaling_pb2.OPERATION_STATE_COMPLETED}
                live = {r: s for r, s in (await agent_states(agent)).items() if s == types_pb2.REPLICA_STATE_ACTIVE}
                assert set(live) == {"a-s0"}  # nothing orphaned on the agent
    finally:
        hole.close()
        procs.close()


async def _eq(coro, expected):
    return await coro == expected


async def _positive(coro):
    return await coro > 0


async def _has(coro, key):
    return key in await coro
