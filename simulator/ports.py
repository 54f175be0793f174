"""The controller core's ports, implemented against the simulated world.

Each call takes the virtual time the scenario's ``transitions`` give it
(``await asyncio.sleep`` on the virtual loop), so the core's own timeouts and
its concurrent per-node calls behave as they do against real agents. The
effect on the world happens at the moment a real agent would apply it:
routing changes and aborts at the start of the call (rollout keeps running
elsewhere meanwhile), a weight sync pauses decoding on the replicas it
updates for its whole duration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from controller.core.ports import ReplicaCallResult, ReplicaSyncOutcome, WeightSyncOutcome

from .scenario import Transitions
from .world import World

Call = tuple[float, str, tuple[str, ...]]
"""One port call as the simulated agent saw it: (virtual time, method, replica ids)."""


class SimRouting:
    """``RoutingPort``: the load balancer's routing table."""

    def __init__(self, world: World, transitions: Transitions, log: list[Call] | None = None) -> None:
        self.world, self.cost = world, transitions.routing_s
        self.calls: list[Call] = [] if log is None else log

    async def take_out(self, replica_ids: Sequence[str], *, why: str = "", abort_in_flight: bool = False) -> None:
        self.calls.append((self.world.now, "remove", tuple(replica_ids)))
        self.world.set_routed(list(replica_ids), False)
        await asyncio.sleep(self.cost)

    async def bring_in(self, replica_ids: Sequence[str]) -> None:
        ids = list(replica_ids)
        self.calls.append((self.world.now, "add", tuple(ids)))
        await asyncio.sleep(self.cost)
        self.world.set_routed(ids, True)

    async def rebalance(self) -> int:
        self.calls.append((self.world.now, "rebalance", ()))
        moved = self.world.rebalance()
        await asyncio.sleep(self.cost)
        return moved

    async def clear_sticky(self) -> None:
        self.calls.append((self.world.now, "clear_sticky", ()))
        await asyncio.sleep(self.cost)


class SimReplicas:
    """``ReplicaPort``: the agents' engine controls."""

    def __init__(self, world: World, transitions: Transitions, log: list[Call] | None = None) -> None:
        self.world, self.tr = world, transitions
        self.calls: list[Call] = [] if log is None else log

    async def abort(self, replica_ids: Sequence[str]) -> ReplicaCallResult:
        self.calls.append((self.world.now, "abort", tuple(replica_ids)))
        aborted = self.world.abort(list(replica_ids))
        await asyncio.sleep(self.tr.abort_s)
        return ReplicaCallResult(aborted_requests=aborted)

    async def sleep(self, replica_ids: Sequence[str], level: int) -> ReplicaCallResult:
        self.calls.append((self.world.now, "sleep", tuple(replica_ids)))
        await asyncio.sleep(self.tr.sleep_s)
        return ReplicaCallResult()

    async def wake(self, replica_ids: Sequence[str]) -> ReplicaCallResult:
        self.calls.append((self.world.now, "wake", tuple(replica_ids)))
        await asyncio.sleep(self.tr.wake_s)
        return ReplicaCallResult()

    async def resume(self, replica_ids: Sequence[str]) -> ReplicaCallResult:
        self.calls.append((self.world.now, "resume", tuple(replica_ids)))
        await asyncio.sleep(self.tr.resume_s)
        return ReplicaCallResult()

    async def stop(self, replica_ids: Sequence[str]) -> ReplicaCallResult:
        self.calls.append((self.world.now, "stop", tuple(replica_ids)))
        return ReplicaCallResult()


class SimWeights:
    """``WeightSyncPort``: one broadcast takes ``weight_sync_s``; receivers stop decoding meanwhile."""

    def __init__(self, world: World, transitions: Transitions, log: list[Call] | None = None) -> None:
        self.world, self.tr = world, transitions
        self.calls: list[Call] = [] if log is None else log

    async def sync(self, replica_ids: Sequence[str], version: int) -> WeightSyncOutcome:
        ids = list(replica_ids)
        self.calls.append((self.world.now, "sync", tuple(ids)))
        self.world.pause(ids, True)
        try:
            await asyncio.sleep(self.tr.weight_sync_s)
        finally:
            self.world.pause(ids, False)
        size = self.tr.model_bytes
        results = tuple(ReplicaSyncOutcome(rid, True, duration_s=self.tr.weight_sync_s, bytes_received=size)
                        for rid in ids)
        return WeightSyncOutcome(weight_version=version, replica_results=results, bytes_sent=size * len(ids),
                                 duration_s=self.tr.weight_sync_s, source="simulator")

    def model_bytes(self) -> int:
        return self.tr.model_bytes
