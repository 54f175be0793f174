"""Where replicas a scale-out adds get their weights: the trainer, a seed replica, or auto (a seed, else the trainer).

The port talks to fake trainer and agent stubs that record every call, so
each test sees which source prepared, which one sent, and the plan it built.
"""

from __future__ import annotations

import asyncio
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
        self.send_error: Exception | None = None
        self.lost_sources: set[str] = set()
        """Receives from these sources fail (their sender went away mid-copy)."""
        self.missing_base: set[str] = set()
        """Replicas that answer a delta plan with delta_base_missing."""
        self.failures: dict[str, int] = {}
        """Replica -> how many of its next receives fail (a relay that died, or one below it)."""
        self.first_prepare_s = 0.0
        """The first PrepareWeightSync takes this long (a trainer encoding the version; repeats are recorded)."""

    async def PrepareWeightSync(self, request, timeout=None):  # noqa: N802
        self.log.append((self.name, "prepare", request.weight_version))
        if self.first_prepare_s:
            await asyncio.sleep(self.first_prepare_s)
            self.first_prepare_s = 0.0
        if isinstance(self.prepared, Exception):
            raise self.prepared
        if isinstance(self.prepared, dict):   # per delta base asked (0: none)
            return self.prepared.get(request.delta_base_version) or self.prepared[0]
        return self.prepared

    async def SendWeights(self, request, timeout=None):  # noqa: N802
        self.log.append((self.name, "send", request.source_id))
        self.plans.append(request.plan)
        if self.send_error is not None:
            raise self.send_error
        return types.SimpleNamespace(bytes_sent=request.plan.manifest.total_bytes)

    async def ReceiveWeights(self, request, timeout=None):  # noqa: N802
        self.log.append((self.name, "receive", tuple(request.replica_ids)))
        self.plans.append(request.plan)
        lost = request.plan.source in self.lost_sources
        results = []
        for r in request.replica_ids:
            no_base = request.plan.HasField("delta") and r in self.missing_base
            broken = self.failures.get(r, 0) > 0
            if broken:
                self.failures[r] -= 1
            results.append(agent_pb.ReplicaWeightsResult(
                replica_id=r, weight_version=request.plan.weight_version, checksum_ok=not (lost or no_base or broken),
                bytes_received=64, delta_base_missing=no_base,
                error_message="peer lost mid-transfer" if lost or broken else "no base" if no_base else ""))
        return agent_pb.ReceiveWeightsResponse(results=results)


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


def mesh(trainer=None, new_on_a=False, **agents):
    """A registry with seeds s0 (node a) and s1 (node b) at version 3, new replica x0 (node c) at 0 (and xa on
    node a with ``new_on_a``)."""
    registry = ReplicaRegistry(clock=lambda: 0.0)
    registry.register_node("a", "a:1", slots_total=2, replicas=[ReplicaSpec("s0", K.STANDALONE, S.ACTIVE, 3)] + (
        [ReplicaSpec("xa", K.STANDALONE, S.SYNCING, 0)] if new_on_a else []))
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


async def test_auto_takes_the_first_seed_that_prepares_and_leaves_the_trainer_alone():
    port, log, stubs, trainer = mesh(trainer=prepared(ws.PrepareWeightSyncResponse, 3, "trainer-t"),
                                     a=rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "holds version 2"),
                                     b=prepared(ws.PrepareWeightSyncResponse, 3, "s1"))
    outcome = await port.sync_new_replicas(["x0"], 3, seeds=["s0", "s1"], source="auto")
    assert not outcome.failed and outcome.source == "s1" and outcome.weight_version == 3
    assert log[:2] == [("a:1", "prepare", 3), ("b:1", "prepare", 3)]
    assert sorted(log[2:]) == [("b:1", "send", "s1"), ("c:1", "receive", ("x0",))]  # concurrently
    assert not trainer.plans
    [plan] = stubs["c:1"].plans
    assert plan.source == "s1" and plan.weight_version == 3 and plan.world_size == 2
    assert [(m.rank, m.replica_id, m.address) for m in plan.members] == [(0, "s1", "b:1"), (1, "x0", "c:1")]
    assert stubs["b:1"].plans == [plan]  # the seed sends exactly the plan the receiver got
    assert outcome.full_copies == {"x0": "s1"} and outcome.attributes()["peer_copies"] == 1
    assert port.in_progress == 0


async def test_auto_uses_the_trainer_when_no_seed_prepares():
    port, log, _, trainer = mesh(trainer=prepared(ws.PrepareWeightSyncResponse, 3, "trainer-t"),
                                 a=rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "holds version 2"))
    outcome = await port.sync_new_replicas(["x0"], 3, seeds=["s0"], source="auto")
    assert not outcome.failed and outcome.source == "trainer-t"
    assert log[:2] == [("a:1", "prepare", 3), ("trainer", "prepare", 3)]
    assert trainer.plans[0].members[0].replica_id == ""
    assert outcome.replica_results[0].copy == "full"


async def test_a_seed_on_the_new_replicas_node_goes_first():
    port, log, _, _ = mesh(a=prepared(ws.PrepareWeightSyncResponse, 3, "s0"),
                           b=prepared(ws.PrepareWeightSyncResponse, 3, "s1"), new_on_a=True)
    outcome = await port.sync_new_replicas(["x0"], 3, seeds=["s1", "s0"], source="replica")
    assert not outcome.failed and log[0] == ("b:1", "prepare", 3)   # x0's node holds no seed: order given
    log.clear()
    outcome = await port.sync_new_replicas(["xa"], 3, seeds=["s1", "s0"], source="replica")
    assert not outcome.failed and outcome.source == "s0" and log[0] == ("a:1", "prepare", 3)


async def test_a_seed_that_dies_mid_copy_is_replaced_by_the_next_source():
    port, log, stubs, trainer = mesh(trainer=prepared(ws.PrepareWeightSyncResponse, 3, "trainer-t"),
                                     a=prepared(ws.PrepareWeightSyncResponse, 3, "s0"),
                                     b=prepared(ws.PrepareWeightSyncResponse, 3, "s1"))
    stubs["a:1"].send_error = rpc_error(grpc.StatusCode.UNAVAILABLE, "seed s0's agent went away")
    stubs["c:1"].lost_sources = {"s0"}
    outcome = await port.sync_new_replicas(["x0"], 3, seeds=["s0", "s1"], source="auto")
    assert not outcome.failed and outcome.source == "s1"
    assert ("a:1", "send", "s0") in log and ("b:1", "send", "s1") in log and not trainer.plans


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


def with_delta(version: int, source: str, base: int) -> ws.PrepareWeightSyncResponse:
    answer = prepared(ws.PrepareWeightSyncResponse, version, source)
    answer.delta.CopyFrom(weights_pb2.WeightDelta(base_version=base, base_checksum="b", changed_words=3,
                                                  total_words=32, stream=weights_pb2.WeightManifest(
                                                      total_bytes=12, bucket_size_bytes=64, checksum="d")))
    return answer


def fleet(trainer, r0_state=S.ACTIVE, r0_version=2, **agents):
    """s0 and s1 (nodes a, b) at version 3, ACTIVE; r0 (node c) at version 2, ACTIVE unless told."""
    registry = ReplicaRegistry(clock=lambda: 0.0)
    for node, replica, version, state in (("a", "s0", 3, S.ACTIVE), ("b", "s1", 3, S.ACTIVE),
                                          ("c", "r0", r0_version, r0_state)):
        kind = K.HYBRID if state is S.SLEEPING else K.STANDALONE
        registry.register_node(node, f"{node}:1", slots_total=1, replicas=[ReplicaSpec(replica, kind, state, version)])
    log: list = []
    stubs = {f"{n}:1": Stub(f"{n}:1", log, agents.get(n)) for n in "abc"}
    trainer_stub = Stub("trainer", log, trainer)
    channels = types.SimpleNamespace(agent=lambda address: stubs[address],
                                     weight_source={**stubs, "t:1": trainer_stub}.get)
    port = WeightBroadcast(channels, registry, Routing(registry, Tables()), trainer_address="t:1", timeout_s=5.0)
    return port, log, stubs, trainer_stub


async def test_replicas_at_the_base_take_the_delta_and_the_others_a_full_copy_from_a_peer():
    port, log, stubs, trainer = fleet(with_delta(4, "trainer-t", 3), a=prepared(ws.PrepareWeightSyncResponse, 4, "s0"))
    outcome = await port.sync(["s0", "s1", "r0"], 4)
    assert not outcome.failed
    [delta_plan] = trainer.plans
    assert delta_plan.delta.base_version == 3 and sorted(m.replica_id for m in delta_plan.members[1:]) == ["s0", "s1"]
    [peer_plan] = stubs["a:1"].plans[-1:]
    assert peer_plan.source == "s0" and not peer_plan.HasField("delta")
    assert [m.replica_id for m in peer_plan.members[1:]] == ["r0"]
    copies = {r.replica_id: (r.copy, r.source) for r in outcome.replica_results}
    assert copies == {"s0": ("delta", "trainer-t"), "s1": ("delta", "trainer-t"), "r0": ("peer", "s0")}
    assert outcome.delta_base_version == 3 and outcome.delta_bytes == 12 and outcome.full_bytes == 64
    assert outcome.delta_density == 3 / 32
    assert outcome.attributes()["delta_copies"] == 2 and outcome.attributes()["peer_copies"] == 1
    assert log.count(("trainer", "prepare", 4)) == 2   # from the base, 3; and from r0's 2, not offered here
    assert ("trainer", "prepare", 4) in log and all(entry[0] != "trainer" or entry[1] != "send" or
                                                    entry[2] == "" for entry in log)


async def test_a_syncs_time_counts_the_trainers_preparation_delta_or_full():
    """The time a step's sync took (its events, the step record, the benchmark) runs from the first
    PrepareWeightSync, where the trainer snapshots the version and encodes the delta, not from the recorded
    answer's repeat; for a delta and for a full copy alike, so the two compare."""
    port, _, _, trainer = fleet(with_delta(4, "trainer-t", 3), r0_version=3)
    trainer.first_prepare_s = 0.2
    outcome = await port.sync(["s0", "s1", "r0"], 4)
    assert not outcome.failed and outcome.attributes()["delta_copies"] == 3
    assert outcome.duration_s >= 0.2
    port, _, _, trainer = fleet(prepared(ws.PrepareWeightSyncResponse, 4, "trainer-t"), r0_version=3)
    trainer.first_prepare_s = 0.2                             # no delta offered: one full broadcast, timed alike
    outcome = await port.sync(["s0", "s1", "r0"], 4)
    assert not outcome.failed and outcome.attributes()["delta_copies"] == 0
    assert outcome.duration_s >= 0.2


async def test_a_replica_further_behind_takes_a_delta_from_its_version_where_the_trainer_offers_one():
    answers = {0: prepared(ws.PrepareWeightSyncResponse, 4, "trainer-t"), 3: with_delta(4, "trainer-t", 3),
               2: with_delta(4, "trainer-t", 2)}
    port, log, stubs, trainer = fleet(answers, a=prepared(ws.PrepareWeightSyncResponse, 4, "s0"))
    outcome = await port.sync(["s0", "s1", "r0"], 4)
    assert not outcome.failed
    assert [(p.delta.base_version, sorted(m.replica_id for m in p.members[1:])) for p in trainer.plans] == [
        (3, ["s0", "s1"]), (2, ["r0"])]                       # the base's delta first, then r0's
    assert [e for e in log if e[1] == "send"] == [("trainer", "send", ""), ("trainer", "send", "")]   # no peer's
    assert {r.replica_id: (r.copy, r.source) for r in outcome.replica_results} == {
        "s0": ("delta", "trainer-t"), "s1": ("delta", "trainer-t"), "r0": ("delta", "trainer-t")}
    assert outcome.bytes_sent == 2 * 64 and outcome.delta_base_version == 3   # two broadcasts (the fake: 64 each)


async def test_a_replica_without_the_base_gets_a_full_copy_and_stays_routed():
    port, log, stubs, trainer = fleet(with_delta(4, "trainer-t", 3), a=prepared(ws.PrepareWeightSyncResponse, 4, "s0"))
    stubs["b:1"].missing_base = {"s1"}   # a restart: the registry says 3, its weights say otherwise
    outcome = await port.sync(["s0", "s1"], 4)
    assert not outcome.failed
    copies = {r.replica_id: r.copy for r in outcome.replica_results}
    assert copies == {"s0": "delta", "s1": "peer"}
    assert "s1" not in port.routing.stale


async def test_without_a_delta_everyone_takes_one_full_broadcast_from_the_trainer():
    port, log, stubs, trainer = fleet(prepared(ws.PrepareWeightSyncResponse, 4, "trainer-t"))
    outcome = await port.sync(["s0", "s1", "r0"], 4)
    assert not outcome.failed and outcome.delta_base_version == -1
    [plan] = trainer.plans
    assert sorted(m.replica_id for m in plan.members[1:]) == ["r0", "s0", "s1"] and not plan.HasField("delta")
    assert {r.copy for r in outcome.replica_results} == {"full"}
    assert [entry for entry in log if entry[0] == "trainer"][0] == ("trainer", "prepare", 4)
    assert log.count(("trainer", "prepare", 4)) == 1   # asking about a delta and sending share one answer


async def test_no_peer_at_the_version_means_the_trainer_sends_the_full_copy():
    port, log, stubs, trainer = fleet(with_delta(4, "trainer-t", 3),
                                      a=rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "busy"),
                                      b=rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "busy"))
    outcome = await port.sync(["s0", "s1", "r0"], 4)
    assert not outcome.failed
    assert {r.replica_id: r.copy for r in outcome.replica_results}["r0"] == "full"
    assert len(trainer.plans) == 2 and not trainer.plans[1].HasField("delta")


async def test_a_sleeping_hybrid_at_the_base_takes_the_delta_and_one_without_its_weights_a_full_copy():
    port, log, stubs, trainer = fleet(with_delta(4, "trainer-t", 3), r0_state=S.SLEEPING, r0_version=3,
                                      a=prepared(ws.PrepareWeightSyncResponse, 4, "s0"))
    outcome = await port.sync(["s0", "s1", "r0"], 4)
    assert {r.replica_id: r.copy for r in outcome.replica_results} == {"s0": "delta", "s1": "delta", "r0": "delta"}
    stubs["c:1"].missing_base = {"r0"}   # asleep at level 2: its weights are gone
    port.registry.set_weight_version("r0", 4)
    trainer.prepared = with_delta(5, "trainer-t", 4)
    stubs["a:1"].prepared = prepared(ws.PrepareWeightSyncResponse, 5, "s0")
    for replica_id in ("s0", "s1"):
        port.registry.set_weight_version(replica_id, 4)
    outcome = await port.sync(["s0", "s1", "r0"], 5)
    assert not outcome.failed
    assert {r.replica_id: r.copy for r in outcome.replica_results} == {"s0": "delta", "s1": "delta", "r0": "peer"}


async def test_a_rollback_to_an_older_version_is_a_full_copy():
    port, log, stubs, trainer = fleet(with_delta(2, "trainer-t", 3))
    outcome = await port.sync(["s0", "s1"], 2)   # both hold 3: nothing below 2 to diff from
    assert not outcome.failed and outcome.delta_base_version == -1
    assert {r.copy for r in outcome.replica_results} == {"full"} and not trainer.plans[0].HasField("delta")


def nodes(layout: dict[str, list[tuple[str, int]]], sources: int = 4, trainer=None):
    """Node -> [(replica, version)] (version 3: a seed, ACTIVE; 0: a new replica, SYNCING); every agent
    prepares as the replica a PrepareWeightSync names."""
    registry = ReplicaRegistry(clock=lambda: 0.0)
    for node, replicas in layout.items():
        registry.register_node(node, f"{node}:1", slots_total=len(replicas), replicas=[
            ReplicaSpec(r, K.STANDALONE, S.ACTIVE if v else S.SYNCING, v) for r, v in replicas])
    log: list = []

    class Agent(Stub):
        async def PrepareWeightSync(self, request, timeout=None):  # noqa: N802
            answer = await super().PrepareWeightSync(request, timeout)
            return prepared(ws.PrepareWeightSyncResponse, answer.weight_version, request.source_id)

    stubs = {f"{node}:1": Agent(f"{node}:1", log, prepared(ws.PrepareWeightSyncResponse, 3, ""))
             for node in layout}
    trainer_stub = Stub("trainer", log, trainer)
    channels = types.SimpleNamespace(agent=lambda address: stubs[address],
                                     weight_source={**stubs, "t:1": trainer_stub}.get)
    port = WeightBroadcast(channels, registry, Routing(registry, Tables()), trainer_address="t:1",
                           timeout_s=5.0, peer_copy_sources=sources)
    return port, log, stubs, trainer_stub


JOIN = {"a": [("s0", 3), ("a1", 0), ("a2", 0)], "b": [("s1", 3), ("s3", 3)], "d": [("s2", 3)],
        "c": [("c1", 0), ("c2", 0)], "e": [("e1", 0), ("e2", 0), ("e3", 0)], "f": [("f1", 0)]}
JOINERS = ["a1", "a2", "c1", "c2", "e1", "e2", "e3", "f1"]


async def test_one_copy_enters_each_node_from_a_peer_there_else_nodes_are_dealt_over_peers_on_other_nodes():
    port, log, stubs, trainer = nodes(JOIN)
    outcome = await port.sync_new_replicas(JOINERS, 3, seeds=["s1", "s3", "s2", "s0"], source="auto")
    assert not outcome.failed and not trainer.plans
    sends = sorted(entry for entry in log if entry[1] == "send")
    assert sends == [("a:1", "send", "s0"), ("b:1", "send", "s1"), ("b:1", "send", "s3"), ("d:1", "send", "s2")]
    # a's joiners from the peer on a; e (the largest) to s1, c to s2 (node d sends nothing yet), f to s3
    assert outcome.full_copies == {"a1": "s0", "a2": "s0", "e1": "s1", "e2": "s1", "e3": "s1", "c1": "s2",
                                   "c2": "s2", "f1": "s3"}
    assert outcome.attributes()["peer_copies"] == 8 and outcome.bytes_sent == 4 * 64
    assert outcome.source == "s0, s1, s2, s3"


async def test_beyond_peer_copy_sources_nodes_join_the_shortest_chain_crossing_between_nodes_once_each():
    port, log, stubs, _ = nodes(JOIN, sources=2)
    outcome = await port.sync_new_replicas(JOINERS, 3, seeds=["s1", "s3", "s2", "s0"], source="replica")
    assert not outcome.failed
    assert sorted(entry for entry in log if entry[1] == "send") == [("a:1", "send", "s0"), ("b:1", "send", "s1")]
    assert outcome.full_copies == {"a1": "s0", "a2": "s0", "c1": "s0", "c2": "s0", "e1": "s1", "e2": "s1",
                                   "e3": "s1", "f1": "s1"}
    [chain] = [plan for plan in stubs["a:1"].plans if plan.source == "s0"][:1]
    assert [m.replica_id for m in chain.members] == ["s0", "a1", "a2", "c1", "c2"]   # its own node first


async def test_one_source_sends_a_single_chain_from_the_nearest_peer():
    port, log, stubs, _ = nodes(JOIN, sources=1)
    outcome = await port.sync_new_replicas(JOINERS, 3, seeds=["s1", "s3", "s2", "s0"], source="replica")
    assert not outcome.failed and [entry for entry in log if entry[1] == "send"] == [("a:1", "send", "s0")]
    [plan] = stubs["a:1"].plans[:1]
    assert [m.replica_id for m in plan.members] == ["s0", *JOINERS]   # a, a, c, c, e, e, e, f


async def test_a_share_whose_source_cannot_prepare_goes_to_another_source():
    port, log, stubs, trainer = nodes({"a": [("s0", 3)], "b": [("s1", 3)], "c": [("c1", 0), ("c2", 0)],
                                       "d": [("d1", 0)]})
    stubs["b:1"].prepared = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "replica 's1' is busy")
    outcome = await port.sync_new_replicas(["c1", "c2", "d1"], 3, seeds=["s0", "s1"], source="auto")
    assert not outcome.failed and not trainer.plans
    assert outcome.full_copies == {"c1": "s0", "c2": "s0", "d1": "s0"}
    assert ("b:1", "prepare", 3) in log and ("b:1", "send", "s1") not in log
    assert [entry for entry in log if entry[1] == "send"] == [("a:1", "send", "s0")] * 2   # c's chain, then d1


async def test_the_replicas_below_a_relay_that_died_are_tried_again_and_the_relay_is_not():
    port, log, stubs, trainer = nodes({"a": [("s0", 3)], "c": [("j1", 0), ("j2", 0), ("j3", 0)]}, sources=1)
    stubs["c:1"].failures = {"j2": 5, "j3": 1}   # the chain's second member dies: the third gets nothing
    outcome = await port.sync_new_replicas(["j1", "j2", "j3"], 3, seeds=["s0"], source="auto")
    assert outcome.failed == {"j2": "peer lost mid-transfer"}
    assert outcome.full_copies == {"j1": "s0", "j3": "j1"}   # again, from the replica done on its node
    assert [entry for entry in log if entry[1] in ("send", "prepare")] == [
        ("a:1", "prepare", 3), ("a:1", "send", "s0"), ("c:1", "prepare", 3), ("c:1", "send", "j1")]
    assert not trainer.plans   # the relay that failed is not tried again, by anyone


async def test_replicas_no_peer_could_reach_go_to_the_trainer_in_one_broadcast():
    port, log, stubs, trainer = nodes({"a": [("s0", 3)], "c": [("c1", 0), ("c2", 0)]},
                                      trainer=prepared(ws.PrepareWeightSyncResponse, 3, "trainer-t"))
    stubs["a:1"].send_error = rpc_error(grpc.StatusCode.UNAVAILABLE, "seed s0's agent went away")
    stubs["c:1"].lost_sources = {"s0"}
    outcome = await port.sync_new_replicas(["c1", "c2"], 3, seeds=["s0"], source="auto")
    assert not outcome.failed and outcome.full_copies == {"c1": "trainer-t", "c2": "trainer-t"}
    [plan] = trainer.plans
    assert [m.replica_id for m in plan.members[1:]] == ["c1", "c2"]


async def test_a_chain_stays_on_the_sources_node_first_and_crosses_between_nodes_once_each():
    port, log, stubs, _ = nodes({"a": [("s0", 3), ("r2", 0)], "b": [("r1", 0), ("r3", 0)], "c": [("r0", 0)]},
                                sources=1)
    outcome = await port.sync_new_replicas(["r0", "r1", "r2", "r3"], 3, seeds=["s0"], source="replica")
    assert not outcome.failed
    [plan] = stubs["a:1"].plans[:1]
    assert [m.replica_id for m in plan.members] == ["s0", "r2", "r1", "r3", "r0"]   # a, a, b, b, c


@pytest.mark.parametrize("value", [0, -2])
def test_peer_copy_sources_below_one_is_refused_naming_the_key(value):
    from controller.config import ControllerConfig
    from mesh_runtime.config import ConfigError

    with pytest.raises(ConfigError, match=f"peer_copy_sources.*must be > 0, got {value}"):
        ControllerConfig(peer_copy_sources=value).validate()
