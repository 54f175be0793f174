"""A weight sync with a dead agent among the receivers: abandoned at once, retried without it.

The fakes behave like a real process group: the sender and every receiver of
a plan wait until all members of that plan have joined, so a member that
never joins holds the others until their timeout, unless the controller
abandons the attempt.
"""

from __future__ import annotations

import asyncio
import time
import types

import grpc
import pytest

from controller.core.records import ReplicaKind, ReplicaSpec, ReplicaState

from controller.core.replicas import ReplicaRegistry
from controller.routing import Routing
from controller.weight_sync import WeightBroadcast
from rollmesh.common.v1 import weights_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as agent_pb
from rollmesh.weights.v1 import weight_source_pb2 as ws

pytestmark = pytest.mark.timeout(60)
S, K = ReplicaState, ReplicaKind
TIMEOUT_S = 20.0  # a sync that waited for the dead member would take this long


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Group:
    """Rendezvous per group id: each member waits until the plan's world has joined."""

    def __init__(self) -> None:
        self.joined: dict[str, set[int]] = {}
        self.changed = asyncio.Condition()
        self.cancelled: list[tuple[str, int]] = []

    async def join(self, plan, rank: int) -> None:
        async with self.changed:
            self.joined.setdefault(plan.group_id, set()).add(rank)
            self.changed.notify_all()
            try:
                await self.changed.wait_for(lambda: len(self.joined[plan.group_id]) == plan.world_size)
            except asyncio.CancelledError:
                self.cancelled.append((plan.group_id, rank))
                raise


class Trainer:
    def __init__(self, group: Group, *, send_error: Exception | None = None) -> None:
        self.group, self.send_error, self.plans = group, send_error, []

    async def PrepareWeightSync(self, request, timeout=None):  # noqa: N802
        return ws.PrepareWeightSyncResponse(
            weight_version=request.weight_version, source="trainer-0", rendezvous_host="127.0.0.1",
            rendezvous_port=4000, manifest=weights_pb2.WeightManifest(total_bytes=64, bucket_size_bytes=64))

    async def SendWeights(self, request, timeout=None):  # noqa: N802
        self.plans.append(request.plan)
        if self.send_error is not None:
            raise self.send_error
        await self.group.join(request.plan, 0)
        return types.SimpleNamespace(bytes_sent=request.plan.manifest.total_bytes)


class Agent:
    def __init__(self, address: str, group: Group, *, dead: bool = False) -> None:
        self.address, self.group, self.dead, self.calls = address, group, dead, 0

    async def ReceiveWeights(self, request, timeout=None):  # noqa: N802
        self.calls += 1
        if self.dead:
            await asyncio.sleep(0.05)
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"failed to connect to {self.address}")
        plan = request.plan
        ranks = {m.replica_id: m.rank for m in plan.members}
        await asyncio.gather(*(self.group.join(plan, ranks[r]) for r in request.replica_ids))
        return agent_pb.ReceiveWeightsResponse(results=[agent_pb.ReplicaWeightsResult(
            replica_id=r, weight_version=plan.weight_version, checksum_ok=True, bytes_received=64)
            for r in request.replica_ids])


class Tables:
    """The balancers' tables, as the routing reconciler writes them."""

    def __init__(self) -> None:
        self.removed: list[str] = []
        self.versions: dict[str, int] = {}

    async def remove_replicas(self, ids, abort_in_flight: bool = False) -> None:
        self.removed += list(ids)

    async def add_replicas(self, records) -> None:
        pass

    async def update_versions(self, versions) -> None:
        self.versions.update(versions)


def build(*, dead=("b:1",), send_error=None):
    registry = ReplicaRegistry(clock=lambda: 0.0)
    for node, address, replicas in (("a", "a:1", ["a0", "a1"]), ("b", "b:1", ["b0"]), ("c", "c:1", ["c0"])):
        registry.register_node(node, address, slots_total=2,
                               replicas=[ReplicaSpec(r, K.STANDALONE, S.ACTIVE, 0) for r in replicas])
    group = Group()
    agents = {a: Agent(a, group, dead=a in dead) for a in ("a:1", "b:1", "c:1")}
    routing = Tables()
    trainer = Trainer(group, send_error=send_error)
    channels = types.SimpleNamespace(agent=lambda address: agents[address], weight_source={"t:1": trainer}.get)
    port = WeightBroadcast(channels, registry, Routing(registry, routing), trainer_address="t:1",
                           timeout_s=TIMEOUT_S)
    return port, agents, trainer, routing, group


async def test_a_dead_agent_is_left_out_and_the_others_get_the_version_without_waiting():
    port, agents, trainer, routing, group = build()
    started = time.monotonic()
    outcome = await port.sync(["a0", "a1", "b0", "c0"], 1)
    assert time.monotonic() - started < TIMEOUT_S / 2  # did not wait out the rendezvous
    assert set(outcome.failed) == {"b0"}
    assert "b:1" in outcome.failed["b0"] and "UNAVAILABLE" in outcome.failed["b0"]
    assert {r.replica_id for r in outcome.replica_results if r.ok} == {"a0", "a1", "c0"}
    assert outcome.bytes_sent == 64
    first, second = trainer.plans
    assert {m.replica_id for m in first.members} == {"", "a0", "a1", "b0", "c0"}
    assert {m.replica_id for m in second.members} == {"", "a0", "a1", "c0"}
    assert second.group_id != first.group_id and second.sync_id != first.sync_id
    assert agents["b:1"].calls == 1  # the dead agent is not asked again
    assert (first.group_id, 0) in group.cancelled  # the sender stopped waiting for the first group
    assert routing.removed == ["b0"] and routing.versions == {"a0": 1, "a1": 1, "c0": 1}
    assert "b0" in port.routing.stale and port.in_progress == 0


async def test_every_agent_dead_fails_all_at_once_without_a_retry():
    port, agents, trainer, routing, _ = build(dead=("a:1", "b:1", "c:1"))
    started = time.monotonic()
    outcome = await port.sync(["a0", "b0", "c0"], 1)
    assert time.monotonic() - started < TIMEOUT_S / 2
    assert set(outcome.failed) == {"a0", "b0", "c0"}
    assert len(trainer.plans) == 1


async def test_a_failed_sender_releases_the_receivers_at_once():
    port, agents, trainer, routing, group = build(dead=(), send_error=rpc_error(
        grpc.StatusCode.ABORTED, "weight broadcast sync-x is in progress"))
    started = time.monotonic()
    outcome = await port.sync(["a0", "c0"], 1)
    assert time.monotonic() - started < TIMEOUT_S / 2
    assert set(outcome.failed) == {"a0", "c0"}
    assert all("ABORTED" in why for why in outcome.failed.values())
    assert len(trainer.plans) == 1  # the sender failing is not an unreachable agent: no retry


async def test_the_call_timeout_bounds_the_plan():
    port, _, trainer, _, _ = build(dead=())
    outcome = await port.sync(["a0"], 2, timeout_s=3.5)
    assert not outcome.failed
    assert trainer.plans[0].timeout.ToNanoseconds() == 3_500_000_000
