"""Native scale-out and scale-in against real balancer, controller and agent processes.

Each operation's path is checked against the state sequence in the event
stream. Scale-out launches replicas on the agent's free slots and routes them;
repeats are NOOP; a request_id makes a retry return the same operation.
Scale-in removes the newest replica first (LIFO), refuses a second operation
while it runs (ABORTED naming it), lets short requests finish (drain) and
aborts long ones at the drain timeout so the balancer resumes them elsewhere:
every request completes with its full token budget.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mesh_runtime.errors import error_info
from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import scaling_pb2
from rollmesh.loadbalancer.v1 import routing_pb2
from tests.controller.scaling.helpers import list_ops, progress, scale_in, scale_out
from tests.controller.scaling.helpers import (
    Procs, agent_states, controller_stub, event_states, finished, generate, in_flight, in_state, lb_stub, replicas,
    routed, until)

pytestmark = pytest.mark.timeout(240)
CONTROLLER = """load_balancer_address: {lb}
lease_ttl_s: 5
load_report_interval_s: 0.2
state_dir: {state}
scale_in_drain_timeout: 3
"""
OUT_PATH = ["PENDING", "CREATING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "READY", "ACTIVE"]
IN_PATH = ["PENDING", "DRAINING", "REMOVING", "COMPLETED"]


async def test_native_scale_out_then_lifo_scale_in_with_requests_in_flight(tmp_path):
    procs = Procs(tmp_path)
    try:
        lb = procs.start("lb", "lb", "")
        ctl_addr = procs.start("controller", "controller", CONTROLLER.format(lb=lb, state=tmp_path / "state"))
        agent = procs.agent("a", controller=ctl_addr, slots=4)
        async with grpc.aio.insecure_channel(ctl_addr) as cch, grpc.aio.insecure_channel(lb) as lch:
            ctl, bal = controller_stub(cch), lb_stub(lch)
            await until(lambda: _eq(routed(bal), ["a-s0"]))

            # Scale out to 3: two new replicas launched on the agent's free slots, routed once ACTIVE.
            reply = await ctl.ScaleOut(scaling_pb2.ScaleOutRequest(num_replicas=3))
            accepted = progress(reply)
            assert reply.name == f"operations/{accepted.operation_id}" and not reply.done
            assert accepted.state == scaling_pb2.OPERATION_STATE_PENDING and accepted.summary
            op = await finished(ctl, accepted.operation_id)
            assert op.state == scaling_pb2.OPERATION_STATE_ACTIVE, op.error_message
            assert await event_states(ctl, op.operation_id) == OUT_PATH
            assert [c.state for c in op.state_history][-1] == scaling_pb2.OPERATION_STATE_ACTIVE
            new = sorted(op.replica_ids)
            assert len(new) == 2 and not op.failed_replica_ids and op.weight_version == 0
            assert await routed(bal) == sorted(["a-s0", *new])
            records = await replicas(ctl)
            assert all(records[r].added_by_operation_id == op.operation_id and not records[r].initial for r in new)
            states = await agent_states(agent)
            assert all(states[r] == types_pb2.REPLICA_STATE_ACTIVE for r in new)

            # Idempotency: the target is met (NOOP); a request_id retry returns the same operation.
            for target in (3, 2):
                again = await scale_out(ctl, num_replicas=target)
                assert again.state == scaling_pb2.OPERATION_STATE_NOOP
            first = await scale_out(ctl, num_replicas=4, request_id="k1")
            retry = await scale_out(ctl, num_replicas=4, request_id="k1")
            assert retry.operation_id == first.operation_id
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await scale_out(ctl, num_replicas=2, request_id="k1")
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
            fourth = await finished(ctl, first.operation_id)
            assert fourth.state == scaling_pb2.OPERATION_STATE_ACTIVE and len(fourth.replica_ids) == 1
            newest = fourth.replica_ids[0]
            with pytest.raises(grpc.aio.AioRpcError) as info:  # the node is full
                await scale_out(ctl, num_replicas=5)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "free slots" in info.value.details()

            # Scale-in to 3 while long requests run: the newest replica goes (LIFO); its requests are
            # aborted at the drain timeout and resumed elsewhere; a concurrent scale request is ABORTED.
            long_runs = [asyncio.create_task(generate(bal, f"long{i}", 400)) for i in range(12)]
            await until(lambda: _positive(in_flight(bal, newest)))
            start = await scale_in(ctl, num_replicas=3)
            assert list(start.replica_ids) == [newest]
            await in_state(ctl, start.operation_id, scaling_pb2.OPERATION_STATE_DRAINING)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await scale_out(ctl, num_replicas=9)
            assert info.value.code() == grpc.StatusCode.ABORTED
            assert error_info(info.value).reason == "SCALE_OPERATION_IN_PROGRESS"
            assert error_info(info.value).metadata["operation_id"] == start.operation_id
            assert newest not in await routed(bal)
            done = await finished(ctl, start.operation_id)
            assert done.state == scaling_pb2.OPERATION_STATE_COMPLETED, done.error_message
            assert await event_states(ctl, done.operation_id) == IN_PATH
            assert "drain timeout" in done.state_history[2].reason
            finals = await asyncio.gather(*long_runs)
            assert all(f.usage.completion_tokens == 400 for f in finals)
            aborted = routing_pb2.ATTEMPT_OUTCOME_ABORTED
            moved = [f for f in finals if any(a.replica_id == newest and a.outcome == aborted for a in f.attempts)]
            assert moved and all(f.attempts[-1].replica_id != newest for f in moved)
            removed = (await replicas(ctl))[newest]
            assert removed.state == types_pb2.REPLICA_STATE_REMOVED and removed.intentionally_removed
            assert (await agent_states(agent))[newest] == types_pb2.REPLICA_STATE_STOPPED

            # Scale-in to 1 with short requests in flight: they finish where they run (no abort).
            short_runs = [asyncio.create_task(generate(bal, f"short{i}", 60)) for i in range(6)]
            await until(lambda: _any_in_flight(bal, new))
            preview = await scale_in(ctl, num_replicas=1, dry_run=True)
            assert sorted(preview.would_remove_replica_ids) == new
            done = await finished(ctl, (await scale_in(ctl, num_replicas=1)).operation_id)
            assert done.state == scaling_pb2.OPERATION_STATE_COMPLETED and sorted(done.replica_ids) == new
            assert "no request in flight" in done.state_history[2].reason
            finals = await asyncio.gather(*short_runs)
            assert all(f.usage.completion_tokens == 60 for f in finals)
            assert not any(a.outcome == routing_pb2.ATTEMPT_OUTCOME_ABORTED for f in finals for a in f.attempts)
            assert await routed(bal) == ["a-s0"]
            listed = await list_ops(ctl, "state = COMPLETED")
            assert [o.operation_id for o in listed] == [done.operation_id, start.operation_id]

            # force skips the drain: requests are aborted at once and finish elsewhere.
            grown = await finished(ctl, (await scale_out(ctl, num_replicas=2)).operation_id)
            extra = grown.replica_ids[0]
            forced_runs = [asyncio.create_task(generate(bal, f"forced{i}", 200)) for i in range(6)]
            await until(lambda: _positive(in_flight(bal, extra)))
            forced = await finished(ctl, (await scale_in(ctl, 
                replica_ids=[extra], force=True)).operation_id)
            assert forced.state == scaling_pb2.OPERATION_STATE_COMPLETED and forced.force
            assert forced.state_history[2].reason.startswith("force: aborted")
            finals = await asyncio.gather(*forced_runs)
            assert all(f.usage.completion_tokens == 200 for f in finals)
            assert await routed(bal) == ["a-s0"]
    finally:
        procs.close()


async def _eq(coro, expected):
    return await coro == expected


async def _positive(coro):
    return await coro > 0


async def _any_in_flight(bal, replica_ids):
    return any([await in_flight(bal, r) > 0 for r in replica_ids])
