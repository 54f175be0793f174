"""A scaled-out replica takes traffic only at the current weight version (known weakness 19).

Real trainer agent (the broadcast source, gloo on loopback), balancer,
controller and a torch replica agent. The mesh serves weight version 1; a
native scale-out launches a replica holding version 0, and WEIGHT_SYNCING
broadcasts version 1 to it before the balancer ever sees it. A scale-in that
arrives while a weight sync runs starts draining only after that sync ends.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from rollmesh.controller.v1 import events_pb2
from rollmesh.controller.v1 import scaling_pb2, weight_sync_pb2

from tests.controller.scaling.helpers import scale_in, scale_out
from tests.controller.scaling.helpers import (
    Procs,
    controller_stub,
    event_states,
    events_of,
    finished,
    lb_stub,
    until,
    versions,
)
from tests.processes import clean_env

pytestmark = pytest.mark.timeout(300)
AGENT = """node_id: a
slots: 2
controller_address: {controller}
weight_transfer: {{gloo_interface: lo}}
replicas: [{{replica_id: a-s0, kind: STANDALONE}}]
"""
CONTROLLER = """load_balancer_address: {lb}
trainer_address: {trainer}
lease_ttl_s: 10
load_report_interval_s: 0.2
async_training: {{weight_sync_timeout_s: 60}}
"""


async def test_new_replicas_are_synced_to_the_current_version_before_routing(tmp_path):
    procs = Procs(tmp_path, env=clean_env(GLOO_SOCKET_IFNAME="lo"))
    try:
        lb = procs.start("lb", "lb", "")
        trainer = procs.start("trainer", "trainer-agent", "model_seed: 5\nadopt_requested_versions: true\n"
        "weight_transfer: {gloo_interface: lo}\n")
        ctl_addr = procs.start("controller", "controller", CONTROLLER.format(lb=lb, trainer=trainer))
        procs.start("a", "replica-agent", AGENT.format(controller=ctl_addr))
        async with grpc.aio.insecure_channel(ctl_addr) as cch, grpc.aio.insecure_channel(lb) as lch:
            ctl, bal = controller_stub(cch), lb_stub(lch)
            await until(lambda: _eq(versions(bal), {"a-s0": 0}))
            synced = await ctl.SyncWeights(weight_sync_pb2.SyncWeightsRequest(weight_version=1))
            assert [r.ok for r in synced.result.replica_results] == [True]
            assert await versions(bal) == {"a-s0": 1}

            # Watch the balancer while the scale-out runs: the new replica never appears below version 1.
            seen: list[dict[str, int]] = []
            stop = asyncio.Event()

            async def watch():
                while not stop.is_set():
                    seen.append(await versions(bal))
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch())
            op = await scale_out(ctl, num_replicas=2)
            op = await finished(ctl, op.operation_id)
            stop.set()
            await watcher
            assert op.state == scaling_pb2.OPERATION_STATE_ACTIVE, op.error_message
            assert op.weight_version == 1
            new = op.replica_ids[0]
            assert await versions(bal) == {"a-s0": 1, new: 1}
            assert all(snapshot.get(new, 1) == 1 for snapshot in seen)
            states = await event_states(ctl, op.operation_id)
            assert states == ["PENDING", "CREATING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "READY", "ACTIVE"]
            syncs = [e for e in await events_of(ctl, events_pb2.EVENT_TYPE_WEIGHT_SYNC_COMPLETED)
                     if e.operation_id == op.operation_id]
            assert len(syncs) == 1 and syncs[0].weight_version == 1

            # A scale-in that arrives while a weight sync runs drains only after it.
            sync = asyncio.ensure_future(ctl.SyncWeights(weight_sync_pb2.SyncWeightsRequest(weight_version=2)))
            await until(lambda: _sync_started(ctl, 2))
            shrink = await scale_in(ctl, num_replicas=1)
            await sync
            done = await finished(ctl, shrink.operation_id)
            assert done.state == scaling_pb2.OPERATION_STATE_COMPLETED and list(done.replica_ids) == [new]
            completed = [e for e in await events_of(ctl, events_pb2.EVENT_TYPE_WEIGHT_SYNC_COMPLETED)
                         if e.weight_version == 2]
            draining = [e for e in await events_of(ctl, events_pb2.EVENT_TYPE_OPERATION_STATE_CHANGED)
                        if e.operation_id == shrink.operation_id and e.to_state == "OPERATION_STATE_DRAINING"]
            assert completed and draining and completed[0].sequence < draining[0].sequence
            assert await versions(bal) == {"a-s0": 2}
    finally:
        procs.close()


async def _eq(coro, expected):
    return await coro == expected


async def _sync_started(ctl, version):
    return any(e.weight_version == version for e in await events_of(ctl, events_pb2.EVENT_TYPE_WEIGHT_SYNC_STARTED))
