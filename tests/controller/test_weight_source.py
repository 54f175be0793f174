"""Where replicas a scale-out adds get their weights: the trainer, a seed replica, or auto (trainer, else a seed).

The port talks to fake trainer and agent stubs that record every call, so
each test sees which source prepared, which one sent, and the plan it built.
"""

from __future__ import annotations

import types

import grpc
import pytest

from controller.core.records import ReplicaKind, ReplicaSpec, ReplicaState

from controller.core.replicas import ReplicaRegistry
from controller.routing import Routing
from controller.weight_sync import WeightBroadcast
from controller.scaling.runs import seed_replicas
from rollmesh.common.v1 import weights_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as agent_pb
from rollmesh.weights.v1 import weight_source_pb2 as ws

pytestmark = pytest.mark.timeout(30)
S, K = ReplicaState, ReplicaKind


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Stub:
    """A trainer or agent stub: PrepareWeightSync answers ``prepared`` (or raises it), the rest succeed."""

    def __init__(self, name: str, log: list, prepared=None) -> None:
        self.name, self.log, self.prepared = name, log, prepared
        self.plans: list[weights_pb2.WeightSyncPlan] = []

    async def PrepareWeightSync(self, request, timeout=None):  # noqa: N802
        self.log.append((self.name, "prepare", request.weight_version))
        if isinstance(self.prepared, Exception):
            raise self.prepared
        return self.prepared

    async def SendWeights(self, request, timeout=None):  # noqa: N802
        self.log.append((self.name, "send", request.source_id))
        self.plans.append(request.plan)
        return types.SimpleNamespace(bytes_sent=request.plan.manifest.total_bytes)

    async def ReceiveWeights(self, request, timeout=None):  # noqa: N802
        self.log.append((self.name, "receive", tuple(request.replica_ids)))
        self.plans.append(request.plan)
        return agent_pb.ReceiveWeightsResponse(results=[agent_pb.ReplicaWeightsResult(
            replica_id=r, weight_version=request.plan.weight_version, checksum_ok=True, bytes_received=64)
            for r in request.replica_ids])


class Tables:
    async def remove_replicas(self, ids, abort_in_flight: bool = False) -> None:
        pass

    async def add_replicas(self, records) -> None:
        pass

    async def update_versions(self, versions) -> None:
        pass


def prepared(cls, version: int, source: str, port: int = 4000):
    return cls(weight_version=version, source=source, rendezvous_host="127.0.0.1", rendezvous_port=port,
               manifest=weights_pb2.WeightManifest(total_bytes=64, bucket_size_bytes=64, checksum="c"))


def mesh(trainer=None, **agents):
    """A registry with seeds s0 (node a) and s1 (node b) at version 3, new replica x0 (node c) at 0."""
    registry = ReplicaRegistry(clock=lambda: 0.0)
    registry.register_node("a", "a:1", slots_total=1, replicas=[ReplicaSpec("s0", K.STANDALONE, S.ACTIVE, 3)])
    registry.register_node("b", "b:1", slots_total=1, replicas=[ReplicaSpec("s1", K.STANDALONE, S.ACTIVE, 3)])
    registry.register_node("c", "c:1", slots_total=1, replicas=[ReplicaSpec("x0", K.STANDALONE, S.SYNCING, 0)])
    log: list = []
    stubs = {address: Stub(address, log, answer) for address, answer in
             {"a:1": agents.get("a"), "b:1": agents.get("b"), "c:1": None}.items()}
    trainer_stub = Stub("trainer", log, trainer)
    stubs_by_address = {**stubs, "t:1": trainer_stub}   # every agent serves WeightSourceService
    channels = types.SimpleNamespace(agent=lambda address: stubs[address], weight_source=stubs_by_address.get)
    port = WeightBroadcast(channels, registry, Routing(registry, Tables()), trainer_address="t:1" if trainer is not None else "",
                           timeout_s=5.0)
    return port, log, stubs, trainer_stub


UNAVAILABLE = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")


async def test_auto_falls_back_to_the_first_seed_that_prepares():
    port, log, stubs, _ = mesh(trainer=UNAVAILABLE,
                               a=rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "holds version 2"),
                               b=prepared(ws.PrepareWeightSyncResponse, 3, "s1"))
    outcome = await port.sync_new_replicas(["x0"], 3, seeds=["s0", "s1"], source="auto")
    assert not outcome.failed and outcome.source == "s1" and outcome.weight_version == 3
    assert log[:3] == [("trainer", "prepare", 3), ("a:1", "prepare", 3), ("b:1", "prepare", 3)]
    assert sorted(log[3:]) == [("b:1", "send", "s1"), ("c:1", "receive", ("x0",))]  # concurrently
    [plan] = stubs["c:1"].plans
    assert plan.source == "s1" and plan.weight_version == 3 and plan.world_size == 2
    assert [(m.rank, m.replica_id, m.address) for m in plan.members] == [(0, "s1", "b:1"), (1, "x0", "c:1")]
    assert stubs["b:1"].plans == [plan]  # the seed sends exactly the plan the receiver got
    assert port.in_progress == 0


async def test_auto_uses_a_trainer_that_prepares_and_no_seed():
    port, log, _, trainer = mesh(trainer=prepared(ws.PrepareWeightSyncResponse, 3, "trainer-t"),
                                 a=prepared(ws.PrepareWeightSyncResponse, 3, "s0"))
    outcome = await port.sync_new_replicas(["x0"], 3, seeds=["s0"], source="auto")
    assert not outcome.failed and outcome.source == "trainer-t"
    assert not any(name == "a:1" for name, *_ in log)
    assert trainer.plans[0].members[0].replica_id == ""


async def test_trainer_only_never_seeds_from_a_replica():
    port, log, _, _ = mesh(trainer=UNAVAILABLE, a=prepared(ws.PrepareWeightSyncResponse, 3, "s0"))
    outcome = await port.sync_new_replicas(["x0"], 3, seeds=["s0"], source="trainer")
    assert "trainer PrepareWeightSync: UNAVAILABLE" in outcome.failed["x0"]
    assert log == [("trainer", "prepare", 3)]


async def test_replica_only_never_asks_the_trainer_and_needs_a_seed():
    port, log, _, _ = mesh(trainer=prepared(ws.PrepareWeightSyncResponse, 3, "trainer-t"))
    outcome = await port.sync_new_replicas(["x0"], 3, seeds=[], source="replica")
    assert outcome.failed == {"x0": "no weight source: no healthy replica at weight version 3 to seed from"}
    assert log == []


async def test_no_source_at_all_says_why_for_each():
    port, log, _, _ = mesh(a=prepared(ws.PrepareWeightSyncResponse, 4, "s0"))
    outcome = await port.sync_new_replicas(["x0"], 3, seeds=["s0"], source="auto")
    reason = outcome.failed["x0"]
    assert "no trainer_address configured" in reason and "prepared weight version 4, not 3" in reason
    assert log == [("a:1", "prepare", 3)]  # a seed at another version sends nothing


def test_seeds_are_healthy_replicas_at_the_version_standalone_first():
    registry = ReplicaRegistry(clock=lambda: 0.0)
    registry.register_node("n", "n:1", slots_total=8, replicas=[
        ReplicaSpec("h0", K.HYBRID, S.ACTIVE, 3), ReplicaSpec("s0", K.STANDALONE, S.ACTIVE, 3),
        ReplicaSpec("s1", K.STANDALONE, S.ACTIVE, 2), ReplicaSpec("s2", K.STANDALONE, S.PAUSED, 3),
        ReplicaSpec("s3", K.STANDALONE, S.ACTIVE, 3), ReplicaSpec("s4", K.STANDALONE, S.ACTIVE, 3),
        ReplicaSpec("s5", K.STANDALONE, S.ACTIVE, 3), ReplicaSpec("x0", K.STANDALONE, S.SYNCING, 0)])
    registry.register_node("m", "m:1", slots_total=1, model_name="other",
                           replicas=[ReplicaSpec("o0", K.STANDALONE, S.ACTIVE, 3)])
    scaler = types.SimpleNamespace(registry=registry, routing=types.SimpleNamespace(stale={"s3"}),
                                   blocks_routing=lambda record: record.replica_id == "s4")
    op = types.SimpleNamespace(model_name="default", replica_ids=["x0", "s5"])
    # s1: older version; s2: not ACTIVE; s3: missed a sync; s4: owned by a scale-in; s5: this operation's;
    # o0: another model. The hybrid one comes after every standalone one.
    assert seed_replicas(scaler, op, 3) == ["s0", "h0"]
