"""The operator's weight requests on fakes: WeightRequests takes its parts as ports (the Mesh wires the real ones),
so SyncWeights, LoadWeights and a group receive run here in-process against a fake broadcast, checkpoint flip and
group, with the real registry, as scale operations and the core's hybrid transitions do."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import pytest

from controller.checkpoint_load import FlipOutcome
from controller.core.events import EventType
from controller.core.ports import ReplicaSyncOutcome, WeightSyncOutcome
from controller.core.records import ReplicaKind, ReplicaSpec, ReplicaState
from controller.core.replicas import ReplicaRegistry
from controller.weight_requests import WeightRequests
from mesh_runtime.errors import FailedPrecondition
from rollmesh.common.v1 import weights_pb2
from rollmesh.controller.v1 import weight_sync_pb2
from tests.controller_core.fakes import FakeClock

pytestmark = pytest.mark.timeout(30)


def _outcome(version: int, replica_ids: Sequence[str], failing: set[str]) -> WeightSyncOutcome:
    return WeightSyncOutcome(version, tuple(
        ReplicaSyncOutcome(r, r not in failing, "receive timed out" if r in failing else "", 0.1, 100)
        for r in replica_ids), bytes_sent=100 * len(replica_ids))


class Parts:
    """Every port of the weight requests, recording what they were asked."""

    timeout_s = 60.0

    def __init__(self, failing: set[str] = frozenset()) -> None:
        self.failing = set(failing)
        self.calls: list[tuple] = []
        self.stale: set[str] = set()
        self.weight_version: int | None = 7
        self.is_hybrid_active = False

    async def sync(self, replica_ids: Sequence[str], version: int, *, timeout_s: float | None = None,
                   source_address: str = ""):
        self.calls.append(("sync", tuple(replica_ids), version, timeout_s, *((source_address,) if source_address
                                                                             else ())))
        return _outcome(version, replica_ids, self.failing)

    async def load(self, replica_ids: Sequence[str], path: str, version: int, *, rollback: bool, timeout_s: float):
        self.calls.append(("load", tuple(replica_ids), path, version, rollback, timeout_s))
        outcome = _outcome(version, replica_ids, self.failing)
        return FlipOutcome(outcome, committed=not outcome.failed, rolled_back=bool(outcome.failed) and rollback)

    async def join(self, replica_ids: Sequence[str], group_name: str, step: Any, timeout_s: float):
        self.calls.append(("join", tuple(replica_ids), group_name))
        return _outcome(0, replica_ids, set())

    async def leave(self, replica_ids: Sequence[str], group_name: str, timeout_s: float):
        self.calls.append(("leave", tuple(replica_ids), group_name))
        return _outcome(0, replica_ids, set())

    async def receive(self, replica_ids, group_name, tensors, version, timeout_s):
        self.calls.append(("receive", tuple(replica_ids), group_name, len(tensors), version))
        outcome = _outcome(version or 0, replica_ids, self.failing)
        return outcome, not outcome.failed

    async def converge(self, replica_ids: Sequence[str], *, abort_in_flight: bool = False) -> None:
        self.calls.append(("converge", tuple(sorted(replica_ids))))


def requests_on_fakes(failing: set[str] = frozenset()):
    clock, events, commits = FakeClock(), [], []
    registry = ReplicaRegistry(clock=clock, lease_ttl_s=30.0)
    registry.register_node("n0", "n0:1", replicas=[
        ReplicaSpec("s0", ReplicaKind.STANDALONE, ReplicaState.ACTIVE, weight_version=6),
        ReplicaSpec("s1", ReplicaKind.STANDALONE, ReplicaState.ACTIVE, weight_version=6),
        ReplicaSpec("h0", ReplicaKind.HYBRID, ReplicaState.SLEEPING, weight_version=5)])
    parts = Parts(failing)

    async def commit() -> None:
        commits.append(len(events))

    requests = WeightRequests(registry=registry, routing=parts, scheduler=parts, weights=parts, checkpoints=parts,
                              groups=parts, transitions=asyncio.Lock(),
                              emit=lambda type, **fields: events.append((type, fields)),
                              span=lambda name, **attributes: contextlib.nullcontext(), commit=commit)
    return requests, registry, parts, events, commits


async def test_a_sync_reaches_every_serving_replica_and_a_failed_one_leaves_routing_until_a_later_sync():
    requests, registry, parts, events, commits = requests_on_fakes(failing={"s1"})
    outcome = await requests.sync_weights([], None, timeout_s=5.0)
    assert parts.calls[0] == ("sync", ("s0", "s1"), 7, 5.0)   # the trainer's version; a sleeping hybrid is left out
    assert outcome.failed == {"s1": "receive timed out"}
    assert registry.get("s0").weight_version == 7 and registry.get("s1").weight_version == 6
    assert parts.stale == {"s1"} and parts.calls[1] == ("converge", ("s1",))
    kinds = [type for type, _ in events]
    assert kinds == [EventType.WEIGHT_SYNC_STARTED, EventType.WEIGHT_SYNC_FAILED, EventType.WEIGHT_SYNC_COMPLETED]
    assert commits == [3]   # committed after every event, before the reply


async def test_named_replicas_must_be_able_to_receive_and_nothing_is_sent_otherwise():
    requests, registry, parts, events, _ = requests_on_fakes()
    registry.transition("s1", ReplicaState.FAILED, "test")
    with pytest.raises(FailedPrecondition, match=r"only ACTIVE, PAUSED or SLEEPING replicas .*s1 \(FAILED\)"):
        await requests.sync_weights(["s0", "s1"], 8, timeout_s=None)
    assert parts.calls == [] and events == []


async def test_a_checkpoint_load_flips_the_version_one_above_the_highest_served():
    requests, registry, parts, events, _ = requests_on_fakes()
    flip = await requests.load_weights("/ckpt/step-9", None, [], rollback=True, timeout_s=None)
    assert parts.calls == [("load", ("s0", "s1"), "/ckpt/step-9", 7, True, 60.0)]   # max served 6 + 1; the bound
    assert flip.committed and {registry.get(r).weight_version for r in ("s0", "s1")} == {7}
    assert events[-1][1]["attributes"]["committed"] is True


async def test_a_group_receive_records_the_version_only_where_it_arrived():
    requests, registry, parts, events, _ = requests_on_fakes(failing={"s0"})
    body = weight_sync_pb2.ReceiveTensorsStep(weight_version=9, tensors=[weights_pb2.TensorSpec(name="w")])
    outcome, committed = await requests.update_from_group(["s0", "s1"], "g", "receive", body, timeout_s=None)
    assert not committed and outcome.failed.keys() == {"s0"}
    assert (registry.get("s0").weight_version, registry.get("s1").weight_version) == (6, 9)
    assert [e for e, fields in events if e is EventType.WEIGHT_SYNC_FAILED and fields["replica_id"] == "s0"]
    await requests.update_from_group(["s1"], "g", "leave", None, timeout_s=None)
    assert parts.calls[-1] == ("leave", ("s1",), "g")
