"""Scale operations on the controller core's fakes: the scaler takes its parts as explicit ports (the Mesh wires
the real ones), so a scale-in runs here against fake routing, weights and agents, in-process and without a
server, as the core's hybrid transitions do."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import pytest

from controller.config import ControllerConfig
from controller.core.records import ReplicaKind, ReplicaSpec, ReplicaState
from controller.core.replicas import ReplicaRegistry
from controller.scaling.operations import OperationState
from controller.scaling.scaler import Scaler
from controller.store import StateStore
from tests.controller_core.fakes import FakeClock, FakeRouting, FakeWeights
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


class Routing(FakeRouting):
    """The core's fake routing, with what scale operations also use of the real one."""

    def __init__(self, log: list, clock: FakeClock) -> None:
        super().__init__(log, clock)
        self.stale: set[str] = set()
        self.balancers: list = []

    async def to_rule(self, replica_ids: Sequence[str]) -> None:
        await self._do("to_rule", tuple(replica_ids))


class Weights(FakeWeights):
    in_progress = False

    async def wait_idle(self) -> None:
        pass


class Agents:
    """The agents a scale-in calls: requests in flight per replica, and stops (``refuse``: stops that fail)."""

    def __init__(self, log: list, in_flight: dict[str, int], refuse: set[str] = frozenset()) -> None:
        self.log, self.counts, self.refuse = log, in_flight, refuse

    async def in_flight(self, address: str, replica_id: str) -> int:
        return self.counts.get(replica_id, 0)

    async def abort_all(self, address: str, replica_id: str) -> None:
        self.log.append(("abort_all", replica_id))
        self.counts[replica_id] = 0

    async def stop(self, address: str, replica_id: str, *, grace_s: float, force: bool) -> None:
        self.log.append(("stop", replica_id, force))
        if replica_id in self.refuse:
            raise ConnectionError(f"{replica_id} does not answer")


def scaler_on_fakes(agents_in_flight: dict[str, int], refuse: set[str] = frozenset()):
    clock, log, events = FakeClock(), [], []
    registry = ReplicaRegistry(clock=clock, lease_ttl_s=30.0)
    registry.register_node("n0", "n0:1", slots_total=3, replicas=[
        ReplicaSpec(f"n0-s{i}", ReplicaKind.STANDALONE, ReplicaState.ACTIVE) for i in range(3)])
    config = ControllerConfig(scale_in_drain_timeout=0.0, scale_in_shutdown_timeout=1.0)
    scaler = Scaler(config, store=StateStore(None), registry=registry, routing=Routing(log, clock),
                    weights=Weights(log, clock), scheduler=type("Scheduler", (), {"weight_version": 3})(),
                    transitions=asyncio.Lock(), calls=Agents(log, agents_in_flight, refuse), clock=clock,
                    emit=lambda type, **fields: events.append((type, fields)),
                    span=lambda name, **attributes: contextlib.nullcontext(),
                    renew=lambda node_id, reports: (clock() + 30.0, True))
    return scaler, registry, log


async def test_a_scale_in_runs_on_fakes_out_of_routing_then_drained_then_stopped():
    scaler, registry, log = scaler_on_fakes({"n0-s2": 2})
    op, chosen, _ = await scaler.scale_in(num_replicas=2)
    assert chosen == ["n0-s2"]
    await wait_until(lambda: op.finished, 10, what="the scale-in to finish")
    assert op.state is OperationState.COMPLETED, op.reason
    # out of routing first, then the requests left are aborted (drain timeout 0), then the replica stops
    assert log == [("remove", ("n0-s2",)), ("abort_all", "n0-s2"), ("stop", "n0-s2", False)]
    assert registry.get("n0-s2").state is ReplicaState.REMOVED
    assert [r.state for r in registry.replicas() if r.replica_id != "n0-s2"] == [ReplicaState.ACTIVE] * 2
    assert not scaler.removing


async def test_a_replica_that_cannot_be_stopped_is_marked_failed_and_said():
    scaler, registry, log = scaler_on_fakes({}, refuse={"n0-s1"})
    op, _, _ = await scaler.scale_in(replica_ids=["n0-s1", "n0-s2"])
    await wait_until(lambda: op.finished, 10, what="the scale-in to finish")
    assert op.state is OperationState.COMPLETED and op.failed_replica_ids == ["n0-s1"]
    assert "not stopped cleanly: n0-s1" in op.error_message
    assert ("stop", "n0-s1", True) in log                  # tried by force after the clean stop failed
    assert {r.replica_id: r.state for r in registry.replicas() if r.replica_id != "n0-s0"} == {
        "n0-s1": ReplicaState.REMOVED, "n0-s2": ReplicaState.REMOVED}
