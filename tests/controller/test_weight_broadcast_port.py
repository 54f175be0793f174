"""The weight-sync port's bookkeeping: stale replicas leave routing and come back after a good sync."""

from __future__ import annotations

import pytest

from controller.core.ports import ReplicaSyncOutcome
from controller.core.records import ReplicaKind, ReplicaSpec, ReplicaState
from controller.core.replicas import ReplicaRegistry
from controller.ports import Channels
from controller.routing import Routing
from controller.weight_sync import WeightBroadcast

pytestmark = pytest.mark.timeout(30)


class FakeTables:
    """The balancers' tables, as the routing reconciler writes them."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def remove_replicas(self, ids, abort_in_flight: bool = False) -> None:
        self.calls.append(("remove", sorted(ids)))

    async def add_replicas(self, records) -> None:
        self.calls.append(("add", sorted(r.replica_id for r in records)))

    async def update_versions(self, versions) -> None:
        self.calls.append(("versions", dict(sorted(versions.items()))))


async def test_a_failed_sync_takes_the_replica_out_of_routing_until_a_later_one_succeeds():
    registry = ReplicaRegistry(clock=lambda: 0.0)
    registry.register_node("n", "127.0.0.1:1", slots_total=2, replicas=[
        ReplicaSpec("s0", ReplicaKind.STANDALONE, ReplicaState.ACTIVE),
        ReplicaSpec("s1", ReplicaKind.STANDALONE, ReplicaState.ACTIVE)])
    routing = FakeTables()
    port = WeightBroadcast(Channels(None), registry, Routing(registry, routing), trainer_address="", timeout_s=1.0)

    await port.push_versions([ReplicaSyncOutcome("s0", True), ReplicaSyncOutcome("s1", False, "timeout")], 3)
    assert routing.calls == [("remove", ["s1"]), ("versions", {"s0": 3})]
    assert port.routing.stale == {"s1"}

    routing.calls.clear()
    await port.push_versions([ReplicaSyncOutcome("s0", True), ReplicaSyncOutcome("s1", True)], 4)
    assert routing.calls == [("versions", {"s0": 4, "s1": 4}), ("add", ["s1"])]
    assert port.routing.stale == set()


async def test_without_a_trainer_every_replica_fails_with_a_clear_reason():
    registry = ReplicaRegistry(clock=lambda: 0.0)
    registry.register_node("n", "127.0.0.1:1", slots_total=1,
                           replicas=[ReplicaSpec("s0", ReplicaKind.STANDALONE, ReplicaState.ACTIVE)])
    port = WeightBroadcast(Channels(None), registry, Routing(registry, FakeTables()), trainer_address="",
                           timeout_s=1.0)
    outcome = await port.sync(["s0"], 2)
    assert outcome.failed == {"s0": "no trainer_address configured"}


async def test_a_replica_back_behind_the_version_is_routed_again_after_its_next_serving_sync(tmp_path, monkeypatch):
    """The multi-host partition test's defect: a node whose lease lapsed during a weight sync re-registers one
    version behind, so its replica is stale. A serving sync holds it SYNCING until the broadcast returns, and
    the stale mark was cleared only for replicas ACTIVE at that moment: it stayed stale, and out of routing
    (reconciliation skips stale replicas), through every later sync. Behind the version, the routing rule
    keeps it out; synced, the rule routes it, and one reconcile round puts it back."""
    from controller.config import ControllerConfig
    from controller.core.ports import WeightSyncOutcome
    from controller.mesh import Mesh
    from mesh_runtime.config import load_config
    from rollmesh.common.v1 import types_pb2
    from rollmesh.controller.v1 import registry_pb2

    mesh = Mesh(load_config(ControllerConfig, None, overrides={
        "state_dir": str(tmp_path / "state"), "trainer_address": "127.0.0.1:1"}), None)
    try:
        mesh.scheduler.weight_version = 5
        await mesh.register_node(registry_pb2.RegisterNodeRequest(
            node_id="n", address="127.0.0.1:2", slots_total=1, replicas=[registry_pb2.ReplicaRegistration(
                replica_id="s0", kind=types_pb2.REPLICA_KIND_STANDALONE, state=types_pb2.REPLICA_STATE_ACTIVE,
                weight_version=4, slots=[0])]))
        assert "s0" not in mesh.routing.wanted() and mesh.routing.must_not_route("s0") is False   # behind: no traffic

        states: list[str] = []

        async def broadcast(replica_ids, version, source, timeout_s, delta_base=0, full=False):   # one broadcast
            states.extend(mesh.registry.get(r).state.value for r in replica_ids)
            return WeightSyncOutcome(version, tuple(ReplicaSyncOutcome(r, True) for r in replica_ids)), "", set()
        monkeypatch.setattr(mesh.weights, "_attempt", broadcast)
        outcome = await mesh.scheduler.ops.sync_serving(["s0"], 6, global_step=1)
        mesh.scheduler.weight_version = 6
        assert outcome.failed == {} and states == ["SYNCING"]   # as every serving sync runs
        assert mesh.registry.get("s0").state.value == "ACTIVE" and mesh.registry.get("s0").weight_version == 6
        assert mesh.routing.stale == set() and "s0" in mesh.routing.wanted()

        class Balancer:   # one reconcile round puts it back
            address = "lb:1"
            added: list[str] = []

            async def routed(self):
                return {}

            async def add_replicas(self, records):
                self.added += [r.replica_id for r in records]
        balancer = Balancer()
        monkeypatch.setattr(mesh.routing.tables, "configured", [balancer])
        assert await mesh.reconcile_routing() == (["s0"], []) and balancer.added == ["s0"]
    finally:
        await mesh.close()


async def test_a_source_named_by_a_sync_is_its_trainer_and_without_a_trainer_agent_the_later_ones_too():
    """SyncWeights' source_address: a trainer process serving its own weights (verl's rank 0) says where it is;
    the broadcast dials it; with no trainer agent configured, the syncs that name none (a scale-out, a hybrid
    waking) dial it too, and a configured trainer agent stays the trainer of those."""
    from mesh_runtime.net import free_port

    registry = ReplicaRegistry(clock=lambda: 0.0)
    registry.register_node("n", "127.0.0.1:1", slots_total=1,
                           replicas=[ReplicaSpec("s0", ReplicaKind.STANDALONE, ReplicaState.ACTIVE)])
    channels = Channels(None)
    source, agent = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"   # nothing listens at either
    alone = WeightBroadcast(channels, registry, Routing(registry, FakeTables()), trainer_address="", timeout_s=1.0)
    configured = WeightBroadcast(channels, registry, Routing(registry, FakeTables()), trainer_address=agent,
                                 timeout_s=1.0)
    try:
        outcomes = [await alone.sync(["s0"], 2, source_address=source), await alone.sync(["s0"], 2)]
        assert alone.trainer() == source
        outcomes.append(await configured.sync(["s0"], 2, source_address=source))
        assert configured.trainer() == agent
        for outcome in outcomes:   # each dialed the named source (gRPC's message names the address it tried)
            assert "trainer PrepareWeightSync: UNAVAILABLE" in outcome.failed["s0"] and source in outcome.failed["s0"]
        assert agent in (await configured.sync(["s0"], 2)).failed["s0"]
    finally:
        await channels.close()
