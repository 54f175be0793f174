"""The weight-sync port's bookkeeping: stale replicas leave routing and come back after a good sync."""

from __future__ import annotations

import pytest

from controller.core.ports import ReplicaSyncOutcome
from controller.core.records import ReplicaKind, ReplicaSpec, ReplicaState
from controller.core.replicas import ReplicaRegistry
from controller.ports import Channels
from controller.weight_sync import WeightBroadcast

pytestmark = pytest.mark.timeout(30)


class FakeRouting:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def remove_replicas(self, ids) -> None:
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
    routing = FakeRouting()
    port = WeightBroadcast(Channels(None), registry, routing, trainer_address="", timeout_s=1.0)

    await port._push_versions([ReplicaSyncOutcome("s0", True), ReplicaSyncOutcome("s1", False, "timeout")], 3)
    assert routing.calls == [("remove", ["s1"]), ("versions", {"s0": 3})]
    assert port.stale == {"s1"}

    routing.calls.clear()
    await port._push_versions([ReplicaSyncOutcome("s0", True), ReplicaSyncOutcome("s1", True)], 4)
    assert routing.calls == [("versions", {"s0": 4, "s1": 4}), ("add", ["s1"])]
    assert port.stale == set()


async def test_without_a_trainer_every_replica_fails_with_a_clear_reason():
    registry = ReplicaRegistry(clock=lambda: 0.0)
    registry.register_node("n", "127.0.0.1:1", slots_total=1,
                           replicas=[ReplicaSpec("s0", ReplicaKind.STANDALONE, ReplicaState.ACTIVE)])
    port = WeightBroadcast(Channels(None), registry, FakeRouting(), trainer_address="", timeout_s=1.0)
    outcome = await port.sync(["s0"], 2)
    assert outcome.failed == {"s0": "no trainer_address configured"}
