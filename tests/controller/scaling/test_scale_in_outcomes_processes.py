"""Scale-in that does not run to completion, against real balancer, controller and agent processes.

- Cancelled while PENDING (it waits for a weight sync that hangs on a trainer
  that never answers): CANCELLED, nothing drained, removed or unrouted.
- Timed out while DRAINING (its ``timeout`` ends before the drain timeout):
  FAILED, and the replica it had not removed yet goes back into routing; the
  requests it was running finish there, never aborted.
- Its replica cannot be stopped (the agent dies while DRAINING, so the clean
  stop and the forced one both fail): FAILED; the replica, already out of
  routing, is marked intentionally removed and never routed again, and the
  requests it was running are resumed elsewhere.

Each path is checked against the state sequence in the event stream.
"""

from __future__ import annotations

import asyncio

import grpc
from google.longrunning import operations_pb2
import pytest

from rollmesh.common.v1 import types_pb2

from rollmesh.controller.v1 import events_pb2
from rollmesh.controller.v1 import scaling_pb2, weight_sync_pb2
from rollmesh.loadbalancer.v1 import routing_pb2
from tests.controller.scaling.helpers import cancel_op, progress, scale_in, scale_in_request, scale_out
from tests.controller.scaling.helpers import (
    Procs,
    agent_states,
    black_hole,
    controller_stub,
    event_states,
    events_of,
    finished,
    generate,
    in_flight,
    in_state,
    lb_stub,
    replicas,
    routed,
    until,
)

pytestmark = pytest.mark.timeout(240)
CONTROLLER = """load_balancer_address: {lb}
lease_ttl_s: 5
load_report_interval_s: 0.2
scale_in_drain_timeout: 60
scale_in_shutdown_timeout: 2
{extra}
"""
ACTIVE = types_pb2.REPLICA_STATE_ACTIVE


async def grow(ctl, bal, target: int) -> str:
    op = await finished(ctl, (await scale_out(ctl, num_replicas=target)).operation_id)
    assert op.state == scaling_pb2.OPERATION_STATE_ACTIVE, op.error_message
    [new] = op.replica_ids
    assert new in await routed(bal)
    return new


async def test_cancel_while_pending_changes_nothing(tmp_path):
    hole, trainer = await black_hole()
    procs = Procs(tmp_path)
    try:
        lb = procs.start("lb", "lb", "")
        ctl_addr = procs.start("controller", "controller", CONTROLLER.format(
            lb=lb, extra=f"trainer_address: {trainer}\nasync_training: {{weight_sync_timeout_s: 120}}"))
        agent = procs.agent("a", controller=ctl_addr, slots=2)
        async with grpc.aio.insecure_channel(ctl_addr) as cch, grpc.aio.insecure_channel(lb) as lch:
            ctl, bal = controller_stub(cch), lb_stub(lch)
            await until(lambda: _eq(routed(bal), ["a-s0"]))
            new = await grow(ctl, bal, 2)

            # A weight sync that hangs on the trainer holds the scale-in in PENDING.
            sync = asyncio.ensure_future(ctl.SyncWeights(weight_sync_pb2.SyncWeightsRequest(
                replica_ids=["a-s0"], weight_version=1)))
            await until(lambda: _sync_started(ctl))
            op = await scale_in(ctl, num_replicas=1)
            assert list(op.replica_ids) == [new]
            await in_state(ctl, op.operation_id, scaling_pb2.OPERATION_STATE_PENDING)
            cancelled = await cancel_op(ctl, op.operation_id)
            assert cancelled.state == scaling_pb2.OPERATION_STATE_CANCELLED
            assert await event_states(ctl, op.operation_id) == ["PENDING", "CANCELLED"]
            assert not sync.done()  # it was cancelled while still waiting, not after the sync ended

            # Nothing was removed: still routed, ACTIVE in the controller and on its agent, never drained.
            assert sorted(await routed(bal)) == sorted(["a-s0", new])
            record = (await replicas(ctl))[new]
            assert record.state == ACTIVE and not record.intentionally_removed
            assert (await agent_states(agent))[new] == ACTIVE
            changes = [e for e in await events_of(ctl, events_pb2.EVENT_TYPE_REPLICA_STATE_CHANGED)
                       if e.replica_id == new]
            assert not any(e.to_state == "REPLICA_STATE_DRAINING" for e in changes)
            final = await finished(ctl, op.operation_id)
            assert final.state == scaling_pb2.OPERATION_STATE_CANCELLED and not final.failed_replica_ids
            sync.cancel()
    finally:
        procs.close()
        hole.close()


async def test_timed_out_drain_restores_routing_and_failed_stop_keeps_it_removed(tmp_path):
    procs = Procs(tmp_path)
    try:
        lb = procs.start("lb", "lb", "")
        ctl_addr = procs.start("controller", "controller", CONTROLLER.format(lb=lb, extra=""))
        procs.agent("a", controller=ctl_addr, slots=1)
        agent_b = procs.agent("b", controller=ctl_addr, slots=2)
        async with grpc.aio.insecure_channel(ctl_addr) as cch, grpc.aio.insecure_channel(lb) as lch:
            ctl, bal = controller_stub(cch), lb_stub(lch)
            await until(lambda: _eq(routed(bal), ["a-s0", "b-s0"]))
            new = await grow(ctl, bal, 3)  # a is full: the new replica lands on b
            assert (await replicas(ctl))[new].node_id == "b"

            # The operation's own timeout (2 s) ends it while DRAINING (drain timeout 60 s): FAILED,
            # and the replica comes back into routing, its requests never aborted.
            runs = [asyncio.create_task(generate(bal, f"t{i}", 300)) for i in range(9)]
            await until(lambda: _positive(in_flight(bal, new)))
            request = scale_in_request(num_replicas=2)
            request.timeout.FromSeconds(2)
            op = progress(await ctl.ScaleIn(request))
            assert list(op.replica_ids) == [new]
            done = await finished(ctl, op.operation_id)
            assert done.state == scaling_pb2.OPERATION_STATE_FAILED
            assert "timed out" in done.error_message and "DRAINING" in done.error_message
            failed = await ctl.ops.GetOperation(operations_pb2.GetOperationRequest(name=f"operations/{op.operation_id}"))
            assert failed.done and failed.error.code == grpc.StatusCode.ABORTED.value[0]
            assert "timed out" in failed.error.message and not failed.HasField("response")
            assert await event_states(ctl, op.operation_id) == ["PENDING", "DRAINING", "FAILED"]
            await until(lambda: _has(routed(bal), new))
            record = (await replicas(ctl))[new]
            assert record.state == ACTIVE and not record.intentionally_removed
            assert (await agent_states(agent_b))[new] == ACTIVE
            changes = [e.to_state for e in await events_of(ctl, events_pb2.EVENT_TYPE_REPLICA_STATE_CHANGED)
                       if e.replica_id == new and e.operation_id == op.operation_id]
            assert changes == ["REPLICA_STATE_DRAINING", "REPLICA_STATE_ACTIVE"]
            finals = await asyncio.gather(*runs)
            assert all(f.usage.completion_tokens == 300 for f in finals)
            assert not any(a.outcome == routing_pb2.ATTEMPT_OUTCOME_ABORTED for f in finals for a in f.attempts)

            # Its agent dies while it drains: the clean and the forced stop both fail. The scale-in
            # ends FAILED; the replica stays out of routing, intentionally removed; no request is lost.
            runs = [asyncio.create_task(generate(bal, f"k{i}", 300)) for i in range(9)]
            await until(lambda: _positive(in_flight(bal, new)))
            op = await scale_in(ctl, num_replicas=2)
            assert list(op.replica_ids) == [new]
            await in_state(ctl, op.operation_id, scaling_pb2.OPERATION_STATE_DRAINING)
            procs.kill("b")
            done = await finished(ctl, op.operation_id)
            assert done.state == scaling_pb2.OPERATION_STATE_FAILED
            assert "could be stopped" in done.error_message and list(done.failed_replica_ids) == [new]
            assert await event_states(ctl, op.operation_id) == ["PENDING", "DRAINING", "REMOVING", "FAILED"]
            record = (await replicas(ctl))[new]
            assert record.state == types_pb2.REPLICA_STATE_REMOVED and record.intentionally_removed
            finals = await asyncio.gather(*runs)
            assert all(f.usage.completion_tokens == 300 for f in finals)
            assert await routed(bal) == ["a-s0"]
    finally:
        procs.close()


async def _eq(coro, expected):
    return await coro == expected


async def _has(coro, item):
    return item in await coro


async def _positive(coro):
    return await coro > 0


async def _sync_started(ctl):
    return bool(await events_of(ctl, events_pb2.EVENT_TYPE_WEIGHT_SYNC_STARTED))
