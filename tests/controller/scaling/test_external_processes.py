"""External scale-out (replica agents running elsewhere, given by address) and its failure paths.

rollback_all (default) fails the operation when one address fails and leaves
nothing behind; keep_partial keeps the good ones; a repeated address is
skipped (NOOP); cancel during CONNECTING rolls back (CANCELLED); a timeout
fails the operation; scale-in by address stops the external replica. Every
path is checked against the state sequence in the event stream. The
controller holds an external node's lease by polling its load reports.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import registry_pb2, scaling_pb2
from tests.controller.scaling.helpers import cancel_op, get_op, scale_in, scale_out
from tests.controller.scaling.helpers import (
    Procs, agent_states, black_hole, closed_port, controller_stub, event_states, finished, in_state, lb_stub, replicas,
    routed, until)

pytestmark = pytest.mark.timeout(240)
CONTROLLER = """load_balancer_address: {lb}
lease_ttl_s: 3
load_report_interval_s: 0.2
state_dir: {state}
async_training: {{port_timeout_s: 20}}
"""


async def test_external_scale_out_policies_dedupe_cancel_timeout_and_scale_in_by_address(tmp_path):
    procs = Procs(tmp_path)
    hole, hole_address = await black_hole()
    try:
        lb = procs.start("lb", "lb", "")
        ctl_addr = procs.start("controller", "controller", CONTROLLER.format(lb=lb, state=tmp_path / "state"))
        procs.agent("a", controller=ctl_addr, slots=1)
        e1, e2 = procs.agent("e1", slots=2), procs.agent("e2", slots=2)
        dead = closed_port()
        async with grpc.aio.insecure_channel(ctl_addr) as cch, grpc.aio.insecure_channel(lb) as lch:
            ctl, bal = controller_stub(cch), lb_stub(lch)
            await until(lambda: _eq(routed(bal), ["a-s0"]))

            # rollback_all: one address fails -> FAILED, the good one is not kept.
            op = await scale_out(ctl, engine_addresses=[e1, dead])
            op = await finished(ctl, op.operation_id)
            assert op.state == scaling_pb2.OPERATION_STATE_FAILED and dead in op.error_message
            assert list(op.failed_replica_ids) == [dead]
            assert await event_states(ctl, op.operation_id) == ["PENDING", "CONNECTING", "FAILED"]
            assert "e1-s0" not in await replicas(ctl) and await routed(bal) == ["a-s0"]
            assert (await agent_states(e1))["e1-s0"] == types_pb2.REPLICA_STATE_ACTIVE  # not ours to stop

            # keep_partial: the good address is kept and serves.
            op = await scale_out(ctl, engine_addresses=[e1, dead],
                                 partial_success_policy=scaling_pb2.PARTIAL_SUCCESS_POLICY_KEEP_PARTIAL)
            op = await finished(ctl, op.operation_id)
            assert op.state == scaling_pb2.OPERATION_STATE_ACTIVE and list(op.failed_replica_ids) == [dead]
            assert op.partial_success_policy == scaling_pb2.PARTIAL_SUCCESS_POLICY_KEEP_PARTIAL
            assert dead in op.error_message and list(op.replica_ids) == ["e1-s0"]
            assert await event_states(ctl, op.operation_id) == ["PENDING", "CONNECTING", "HEALTH_CHECKING",
                                                                "WEIGHT_SYNCING", "READY", "ACTIVE"]
            assert await routed(bal) == ["a-s0", "e1-s0"]
            record = (await replicas(ctl))["e1-s0"]
            assert record.address == e1 and not record.initial and record.added_by_operation_id == op.operation_id

            # Dedupe: a known address is skipped; only known addresses -> NOOP.
            noop = await scale_out(ctl, engine_addresses=[e1])
            assert noop.state == scaling_pb2.OPERATION_STATE_NOOP

            # The controller holds the external node's lease (it pushes no reports itself).
            await asyncio.sleep(4)  # longer than lease_ttl_s
            node = (await ctl.GetNode(registry_pb2.GetNodeRequest(node_id="e1"))).node
            assert node.lease_held and (await replicas(ctl))["e1-s0"].state == types_pb2.REPLICA_STATE_ACTIVE

            # Cancel while CONNECTING (one address never answers): CANCELLED, e2 rolled back.
            op = await scale_out(ctl, engine_addresses=[e2, hole_address])
            await in_state(ctl, op.operation_id, scaling_pb2.OPERATION_STATE_CONNECTING)
            cancelled = await cancel_op(ctl, op.operation_id)
            assert cancelled.state == scaling_pb2.OPERATION_STATE_CANCELLED
            assert await event_states(ctl, op.operation_id) == ["PENDING", "CONNECTING", "CANCELLED"]
            again = await cancel_op(ctl, op.operation_id)
            assert again.state == scaling_pb2.OPERATION_STATE_CANCELLED
            assert "e2-s0" not in await replicas(ctl) and await routed(bal) == ["a-s0", "e1-s0"]

            # Batch cancel: the dry run names the running operation and changes nothing.
            op = await scale_out(ctl, engine_addresses=[hole_address])
            preview = await ctl.CancelOperations(scaling_pb2.CancelOperationsRequest(dry_run=True))
            assert list(preview.cancelled_operation_ids) == [op.operation_id]
            current = await get_op(ctl, op.operation_id)
            assert current.state not in (scaling_pb2.OPERATION_STATE_CANCELLED, scaling_pb2.OPERATION_STATE_FAILED)
            reply = await ctl.CancelOperations(scaling_pb2.CancelOperationsRequest(
                states=[scaling_pb2.OPERATION_STATE_PENDING, scaling_pb2.OPERATION_STATE_CONNECTING]))
            assert list(reply.cancelled_operation_ids) == [op.operation_id]
            assert (await finished(ctl, op.operation_id)).state == scaling_pb2.OPERATION_STATE_CANCELLED

            # Timeout: FAILED, saying so.
            op = await scale_out(ctl, engine_addresses=[hole_address],
                                                                 timeout={"seconds": 1})
            op = await finished(ctl, op.operation_id)
            assert op.state == scaling_pb2.OPERATION_STATE_FAILED and "timed out" in op.error_message

            # Scale-in by address: the external replica is drained and stopped.
            op = await scale_in(ctl, engine_addresses=[e1])
            assert list(op.replica_ids) == ["e1-s0"]
            op = await finished(ctl, op.operation_id)
            assert op.state == scaling_pb2.OPERATION_STATE_COMPLETED
            assert await event_states(ctl, op.operation_id) == ["PENDING", "DRAINING", "REMOVING", "COMPLETED"]
            assert (await agent_states(e1))["e1-s0"] == types_pb2.REPLICA_STATE_STOPPED
            assert await routed(bal) == ["a-s0"]
            with pytest.raises(grpc.aio.AioRpcError) as info:  # finished: not cancellable
                await cancel_op(ctl, op.operation_id)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "COMPLETED" in info.value.details()

            # A scale-in whose replica cannot be stopped (its agent died) ends FAILED; the replica stays
            # out of routing, marked intentionally removed, so it is never taken back.
            op = await finished(ctl, (await scale_out(ctl, engine_addresses=[e2])).operation_id)
            assert op.state == scaling_pb2.OPERATION_STATE_ACTIVE and await routed(bal) == ["a-s0", "e2-s0"]
            procs.kill("e2")
            op = await finished(ctl, (await scale_in(ctl, replica_ids=["e2-s0"])).operation_id)
            assert op.state == scaling_pb2.OPERATION_STATE_FAILED and "could be stopped" in op.error_message
            assert list(op.failed_replica_ids) == ["e2-s0"]
            assert await event_states(ctl, op.operation_id) == ["PENDING", "DRAINING", "REMOVING", "FAILED"]
            record = (await replicas(ctl))["e2-s0"]
            assert record.state == types_pb2.REPLICA_STATE_REMOVED and record.intentionally_removed
            assert await routed(bal) == ["a-s0"]
    finally:
        hole.close()
        procs.close()


async def _eq(coro, expected):
    return await coro == expected
