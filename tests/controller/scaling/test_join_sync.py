"""A join's weight copy from a peer leaves the training steps alone: it runs outside the transitions lock (the
lock every step-protocol call takes), copies again while the steps ran more than a version ahead, and the new
replicas then catch up with any version the steps moved on to meanwhile, under the lock, before they are
routed. A copy only the trainer can send runs under the lock."""

from __future__ import annotations

import asyncio
import contextlib
import types

import pytest

from controller.config import ControllerConfig
from controller.core.ports import ReplicaSyncOutcome, WeightSyncOutcome
from controller.core.records import ReplicaKind, ReplicaSpec, ReplicaState
from controller.core.replicas import ReplicaRegistry
from controller.scaling import runs
from controller.scaling.operations import OperationState, OperationType, ScaleOperation

pytestmark = pytest.mark.timeout(30)
S = ReplicaState


class Weights:
    """Records each sync; a peer copy waits for ``release`` so the test can act while it runs."""

    def __init__(self, lock: asyncio.Lock) -> None:
        self.lock, self.calls = lock, []
        self.copying = asyncio.Event()
        self.release = asyncio.Event()
        self.during_copy = lambda: None
        """What the steps do while a peer copy is on the wire."""

    async def sync_new_replicas(self, replica_ids, version, *, seeds, source):
        self.calls.append(("copy", tuple(replica_ids), version, source, self.lock.locked()))
        if source == "replica":
            self.copying.set()
            await self.release.wait()
            self.during_copy()
        return WeightSyncOutcome(version, tuple(ReplicaSyncOutcome(r, True, copy="peer" if source == "replica"
                                                                   else "full") for r in replica_ids),
                                 source=seeds[0] if seeds else "trainer-t")

    async def sync(self, replica_ids, version):
        self.calls.append(("sync", tuple(replica_ids), version, None, self.lock.locked()))
        return WeightSyncOutcome(version, tuple(ReplicaSyncOutcome(r, True, copy="delta") for r in replica_ids))


def host(seeded: bool, seed_version: int = 4):
    registry = ReplicaRegistry(clock=lambda: 0.0)
    registry.register_node("a", "a:1", slots_total=3, replicas=[
        ReplicaSpec("s0", ReplicaKind.STANDALONE, S.ACTIVE, seed_version)] if seeded else [])
    registry.register_node("b", "b:1", slots_total=2, replicas=[ReplicaSpec("new", ReplicaKind.STANDALONE,
                                                                            S.LOADING, 0)])
    lock = asyncio.Lock()
    scheduler = types.SimpleNamespace(weight_version=4)
    moves: list = []

    async def move(op, state, reason=""):
        moves.append(state)

    async def save():
        pass

    def current_version(model_name, exclude=frozenset()):
        return scheduler.weight_version

    s = types.SimpleNamespace(
        config=ControllerConfig(), registry=registry, weights=Weights(lock), transitions=lock,
        routing=types.SimpleNamespace(stale=set()), removing=set(), emit=lambda *a, **k: None,
        span=lambda *a, **k: contextlib.nullcontext(), move=move, save=save, current_version=current_version,
        blocks_routing=lambda record: False, scheduler=scheduler)
    op = ScaleOperation(operation_id="op-1", type=OperationType.SCALE_OUT, state=OperationState.HEALTH_CHECKING,
                        replica_ids=["new"])
    return s, op, scheduler


async def test_a_peer_copy_runs_outside_the_lock_and_the_new_replica_catches_up_before_routing():
    s, op, scheduler = host(seeded=True)
    task = asyncio.create_task(runs._sync(s, op, ["new"]))
    await asyncio.wait_for(s.weights.copying.wait(), 5)
    # a training step runs while the copy is on the wire: it takes the lock at once and moves to version 5
    await asyncio.wait_for(s.transitions.acquire(), 1)
    scheduler.weight_version = 5
    s.transitions.release()
    s.weights.release.set()
    await asyncio.wait_for(task, 5)
    assert s.weights.calls == [("copy", ("new",), 4, "replica", False), ("sync", ("new",), 5, None, True)]
    assert op.weight_version == 5 and s.registry.get("new").weight_version == 5


async def test_without_a_peer_the_trainer_copies_under_the_lock():
    s, op, _ = host(seeded=False)
    await asyncio.wait_for(runs._sync(s, op, ["new"]), 5)
    assert s.weights.calls == [("copy", ("new",), 4, "trainer", True)]
    assert op.weight_version == 4 and s.registry.get("new").weight_version == 4


async def test_while_the_serving_replicas_are_still_being_synced_the_join_copies_their_version_then_catches_up():
    s, op, _ = host(seeded=True, seed_version=3)   # the step announced version 4; the serving sync has not ended
    s.weights.release.set()
    await asyncio.wait_for(runs._sync(s, op, ["new"]), 5)
    assert s.weights.calls == [("copy", ("new",), 3, "replica", False), ("sync", ("new",), 4, None, True)]
    assert op.weight_version == 4 and s.registry.get("new").weight_version == 4


async def test_a_join_the_steps_ran_more_than_a_version_ahead_of_copies_again_from_peers_outside_the_lock():
    s, op, scheduler = host(seeded=True)
    s.weights.release.set()

    def two_steps():   # the steps (and the peer with them) move on by two versions during the first copy only
        if scheduler.weight_version == 4:
            scheduler.weight_version = 6
            s.registry.set_weight_version("s0", 6)

    s.weights.during_copy = two_steps
    await asyncio.wait_for(runs._sync(s, op, ["new"]), 5)
    assert s.weights.calls == [("copy", ("new",), 4, "replica", False), ("copy", ("new",), 6, "replica", False)]
    assert op.weight_version == 6 and s.registry.get("new").weight_version == 6   # nothing left under the lock


async def test_a_join_slower_than_the_steps_copies_again_a_bounded_number_of_times_then_catches_up_under_the_lock():
    s, op, scheduler = host(seeded=True)
    s.weights.release.set()

    def two_steps():   # every copy takes two steps
        scheduler.weight_version += 2
        s.registry.set_weight_version("s0", scheduler.weight_version)

    s.weights.during_copy = two_steps
    await asyncio.wait_for(runs._sync(s, op, ["new"]), 5)
    copies = [call for call in s.weights.calls if call[0] == "copy"]
    assert [call[2] for call in copies] == [4, 6, 8] and len(copies) == 1 + runs.KEEP_UP_ROUNDS
    assert not any(call[4] for call in copies)
    assert s.weights.calls[-1] == ("sync", ("new",), 10, None, True)
    assert op.weight_version == 10 and s.registry.get("new").weight_version == 10
