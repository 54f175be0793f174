"""Fake clock and ports for the controller-core tests.

Each fake appends its calls to a shared log (so tests can assert the exact
order) and advances the fake clock by a configured cost, so measured
durations are exact numbers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from controller.core import ReplicaCallResult, ReplicaSyncOutcome, WeightSyncOutcome


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class FakeRouting:
    def __init__(self, log: list, clock: FakeClock, cost: float = 0.0) -> None:
        self.log, self.clock, self.cost = log, clock, cost
        self.fail: set[str] = set()   # method names that raise
        self.routed: set[str] = set()
        self.during: dict[str, Any] = {}
        """``during[method]()`` runs inside the call (something else happening while it awaits the balancer)."""

    async def _do(self, name: str, *args: Any) -> None:
        self.log.append((name, *args))
        if name in self.during:
            self.during.pop(name)()
        self.clock.advance(self.cost)
        if name in self.fail:
            raise ConnectionError(f"{name} refused")

    async def take_out(self, replica_ids: Sequence[str], *, why: str = "", abort_in_flight: bool = False) -> None:
        await self._do("remove", tuple(replica_ids))
        self.routed -= set(replica_ids)

    async def bring_in(self, replica_ids: Sequence[str]) -> None:
        await self._do("add", tuple(replica_ids))
        self.routed |= set(replica_ids)

    async def rebalance(self) -> None:
        await self._do("rebalance")

    async def clear_sticky(self) -> None:
        await self._do("clear_sticky")


class FakeReplicas:
    """``fail[method][replica] = reason`` reports a per-replica failure;
    ``raise_for[method]`` raises for calls touching those replicas;
    ``hang[method]`` never returns for calls touching those replicas."""

    def __init__(self, log: list, clock: FakeClock, costs: dict[str, float] | None = None) -> None:
        self.log, self.clock = log, clock
        self.costs = costs or {}
        self.fail: dict[str, dict[str, str]] = {}
        self.raise_for: dict[str, set[str]] = {}
        self.hang: dict[str, set[str]] = {}
        self.during: dict[str, Any] = {}
        """``during[method]()`` runs inside the call (something else happening while it awaits the agent)."""
        self.aborted_per_replica = 3

    async def _do(self, name: str, ids: Sequence[str], *extra: Any) -> ReplicaCallResult:
        self.log.append((name, tuple(ids), *extra))
        if name in self.during:
            self.during.pop(name)()
        self.clock.advance(self.costs.get(name, 0.0))
        if set(ids) & self.hang.get(name, set()):
            await asyncio.Event().wait()
        if set(ids) & self.raise_for.get(name, set()):
            raise ConnectionError(f"{name}: agent unreachable")
        failed = {rid: why for rid, why in self.fail.get(name, {}).items() if rid in ids}
        aborted = self.aborted_per_replica * len(ids) if name == "abort" else 0
        return ReplicaCallResult(failed=failed, aborted_requests=aborted)

    async def abort(self, replica_ids: Sequence[str]) -> ReplicaCallResult:
        return await self._do("abort", replica_ids)

    async def sleep(self, replica_ids: Sequence[str], level: int) -> ReplicaCallResult:
        return await self._do("sleep", replica_ids, level)

    async def wake(self, replica_ids: Sequence[str]) -> ReplicaCallResult:
        return await self._do("wake", replica_ids)

    async def resume(self, replica_ids: Sequence[str]) -> ReplicaCallResult:
        return await self._do("resume", replica_ids)

    async def stop(self, replica_ids: Sequence[str]) -> ReplicaCallResult:
        return await self._do("stop", replica_ids)


class FakeWeights:
    def __init__(self, log: list, clock: FakeClock, model_bytes: int = 1000, cost: float = 0.0) -> None:
        self.log, self.clock, self.cost, self._model_bytes = log, clock, cost, model_bytes
        self.fail: dict[str, str] = {}
        self.raise_error: Exception | None = None
        self.hang = False

    async def sync(self, replica_ids: Sequence[str], version: int) -> WeightSyncOutcome:
        self.log.append(("sync", tuple(replica_ids), version))
        self.clock.advance(self.cost)
        if self.hang:
            await asyncio.Event().wait()
        if self.raise_error is not None:
            raise self.raise_error
        results = tuple(ReplicaSyncOutcome(rid, rid not in self.fail, self.fail.get(rid, ""),
                                           bytes_received=0 if rid in self.fail else self._model_bytes)
                        for rid in replica_ids)
        return WeightSyncOutcome(weight_version=version, replica_results=results,
                                 bytes_sent=self._model_bytes * len(replica_ids), duration_s=self.cost)

    def model_bytes(self) -> int:
        return self._model_bytes
