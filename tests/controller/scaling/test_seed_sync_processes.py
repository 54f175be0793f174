"""Scale-out seeds new replicas from a healthy replica at the current version (no usable trainer).

Real trainer agent, balancer, controller and a torch replica agent (gloo on
loopback). The trainer (preset seed 5) brings a-s0 to version 1, so a-s0's
weights differ from the preset-seed-0 weights a freshly launched replica
loads. Then the weights of a new replica must come from a-s0:

- ``auto`` with the trainer killed: the trainer cannot prepare, a-s0 seeds.
- ``replica`` with the trainer alive: the configured choice, a-s0 seeds.

Either way the new replica's weights equal a-s0's (manifest checksum), it is
at a-s0's version, and the balancer routes it only after the sync.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from rollmesh.controller.v1 import events_pb2
from rollmesh.controller.v1 import scaling_pb2, weight_sync_pb2
from rollmesh.weights.v1 import weight_source_pb2 as ws
from rollmesh.weights.v1 import weight_source_pb2_grpc

from tests.controller.scaling.helpers import scale_out
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
scale_out_weight_source: {source}
lease_ttl_s: 10
load_report_interval_s: 0.2
async_training: {{weight_sync_timeout_s: 60}}
"""


async def weights_of(agent: str, replica_id: str) -> tuple[int, str]:
    """(version, manifest checksum) of a replica's live weights, from its agent."""
    async with grpc.aio.insecure_channel(agent) as channel:
        prepared = await weight_source_pb2_grpc.WeightSourceServiceStub(channel).PrepareWeightSync(
            ws.PrepareWeightSyncRequest(source_id=replica_id), timeout=60)
    return prepared.weight_version, prepared.manifest.checksum


async def scale_out_from_seed(tmp_path, source: str, *, kill_trainer: bool) -> None:
    procs = Procs(tmp_path, env=clean_env(GLOO_SOCKET_IFNAME="lo"))
    try:
        lb = procs.start("lb", "lb", "")
        trainer = procs.start("trainer", "trainer-agent", "model_seed: 5\nadopt_requested_versions: true\n"
        "weight_transfer: {gloo_interface: lo}\n")
        ctl_addr = procs.start("controller", "controller", CONTROLLER.format(lb=lb, trainer=trainer, source=source))
        agent = procs.start("a", "replica-agent", AGENT.format(controller=ctl_addr))
        async with grpc.aio.insecure_channel(ctl_addr) as cch, grpc.aio.insecure_channel(lb) as lch:
            ctl, bal = controller_stub(cch), lb_stub(lch)
            await until(lambda: _eq(versions(bal), {"a-s0": 0}))
            launched_weights = await weights_of(agent, "a-s0")  # what a fresh replica loads (preset seed 0)
            synced = await ctl.SyncWeights(weight_sync_pb2.SyncWeightsRequest(weight_version=1))
            assert [r.ok for r in synced.result.replica_results] == [True]
            seed_weights = await weights_of(agent, "a-s0")
            assert seed_weights[0] == 1 and seed_weights[1] != launched_weights[1]
            if kill_trainer:
                procs.kill("trainer")

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
            [new] = op.replica_ids
            assert await weights_of(agent, new) == seed_weights  # the seed's version and its exact bytes
            assert await versions(bal) == {"a-s0": 1, new: 1}
            assert all(snapshot.get(new, 1) == 1 for snapshot in seen)  # never routed below version 1

            states = await event_states(ctl, op.operation_id)
            assert states == ["PENDING", "CREATING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "READY", "ACTIVE"]
            [sync] = [e for e in await events_of(ctl, events_pb2.EVENT_TYPE_WEIGHT_SYNC_COMPLETED)
                      if e.operation_id == op.operation_id]
            assert sync.weight_version == 1 and sync.attributes["source"] == "a-s0"
            [ready] = [e for e in await events_of(ctl, events_pb2.EVENT_TYPE_OPERATION_STATE_CHANGED)
                       if e.operation_id == op.operation_id and e.to_state == "OPERATION_STATE_READY"]
            assert sync.sequence < ready.sequence  # routed only once it holds the seed's weights
    finally:
        procs.close()


async def test_auto_seeds_from_a_replica_when_the_trainer_is_gone(tmp_path):
    await scale_out_from_seed(tmp_path, "auto", kill_trainer=True)


async def test_configured_replica_source_seeds_even_with_a_trainer(tmp_path):
    await scale_out_from_seed(tmp_path, "replica", kill_trainer=False)


async def _eq(coro, expected):
    return await coro == expected
