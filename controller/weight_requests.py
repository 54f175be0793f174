"""The operator's weight requests as one feature: SyncWeights (a broadcast of the trainer's version), LoadWeights
(a checkpoint on disk as one fleet-wide version flip, :mod:`controller.checkpoint_load`) and
UpdateWeightsFromGroup (weights from a trainer's own process group, :mod:`controller.group_update`).

Each takes the one lock of routing and weight changes, records the versions replicas now hold, takes a
replica that did not take them out of routing, emits the lifecycle events and commits the state; the
:class:`~controller.mesh.Mesh` wires its ports (the protocols below), and a test wires fakes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from mesh_runtime.errors import FailedPrecondition
from mesh_runtime.reasons import Reason
from rollmesh.common.v1 import weights_pb2

from .checkpoint_load import FlipOutcome
from .core.events import EventType
from .core.ports import WeightSyncOutcome
from .core.records import ReplicaKind, ReplicaState
from .core.replicas import ReplicaRegistry


class Broadcast(Protocol):
    """The trainer's broadcast (:class:`~controller.weight_sync.WeightBroadcast`)."""

    timeout_s: float
    """The configured bound of one weight operation, seconds."""

    async def sync(self, replica_ids: Sequence[str], version: int, *,
                   timeout_s: float | None = None, source_address: str = "") -> WeightSyncOutcome: ...


class Checkpoints(Protocol):
    """A checkpoint on disk as one version flip (:class:`~controller.checkpoint_load.CheckpointFlip`)."""

    async def load(self, replica_ids: Sequence[str], path: str, version: int, *, rollback: bool,
                   timeout_s: float) -> FlipOutcome: ...


class Groups(Protocol):
    """A trainer's own process group (:class:`~controller.group_update.GroupUpdate`)."""

    async def join(self, replica_ids: Sequence[str], group_name: str, step: Any,
                   timeout_s: float) -> WeightSyncOutcome: ...

    async def leave(self, replica_ids: Sequence[str], group_name: str, timeout_s: float) -> WeightSyncOutcome: ...

    async def receive(self, replica_ids: Sequence[str], group_name: str, tensors: Sequence[weights_pb2.TensorSpec],
                      version: int | None, timeout_s: float) -> tuple[WeightSyncOutcome, bool]: ...


class StaleRouting(Protocol):
    """Who is routed (:class:`~controller.routing.Routing`): a replica whose sync failed is stale, out of routing
    until a later sync reaches it."""

    stale: set[str]

    async def converge(self, replica_ids: Sequence[str], *, abort_in_flight: bool = False) -> None: ...


class TrainerVersion(Protocol):
    """What the requests read of the hybrid scheduler."""

    weight_version: int | None

    @property
    def is_hybrid_active(self) -> bool: ...


class WeightRequests:
    """See the module docstring."""

    def __init__(self, *, registry: ReplicaRegistry, routing: StaleRouting, scheduler: TrainerVersion,
                 weights: Broadcast, checkpoints: Checkpoints, groups: Groups,
                 transitions: asyncio.Lock, emit: Callable[..., Any],
                 span: Callable[..., AbstractContextManager[Any]], commit: Callable[[], Awaitable[None]]) -> None:
        self.registry, self.routing, self.scheduler = registry, routing, scheduler
        self.weights, self.checkpoints, self.groups = weights, checkpoints, groups
        self.transitions, self.emit, self.span, self.commit = transitions, emit, span, commit

    async def sync_weights(self, replica_ids: list[str], version: int | None, *,
                           timeout_s: float | None, source_address: str = "") -> WeightSyncOutcome:
        """A requested weight sync (SyncWeights): ``version`` (None: the trainer's current one) to the named
        replicas, or to every serving one (hybrid replicas while they are active). A replica that does not
        take it leaves routing until it holds the current version. ``source_address``: the weight source of this
        sync (a trainer process serving its own weights), see :meth:`Broadcast.sync`; empty: the trainer's."""
        targets = self._weight_targets(replica_ids)
        if version is None:
            version = self.scheduler.weight_version or 0
        self.emit(EventType.WEIGHT_SYNC_STARTED, weight_version=version, reason="SyncWeights",
                  attributes={"replicas": len(targets)})
        async with self.transitions:
            with self.span("weights.broadcast", weight_version=version, replica_ids=targets):
                outcome = await self.weights.sync(targets, version, timeout_s=timeout_s,
                                                  source_address=source_address)
        failed = outcome.failed
        for result in outcome.replica_results:
            if result.ok:
                self.registry.set_weight_version(result.replica_id, version)
        if failed:
            self.routing.stale.update(failed)
            await self.routing.converge(list(failed))
            for replica_id, why in failed.items():
                self.emit(EventType.WEIGHT_SYNC_FAILED, replica_id=replica_id, weight_version=version,
                          reason=f"{why}; removed from routing until it holds the current version")
        self.emit(EventType.WEIGHT_SYNC_COMPLETED, weight_version=version, reason="SyncWeights",
                  attributes={"ok": len(targets) - len(failed), "failed": len(failed),
                              **outcome.attributes()})
        await self.commit()
        return outcome

    def _weight_targets(self, replica_ids: list[str]) -> list[str]:
        """The named replicas (each must be able to receive), or every serving one: standalone replicas, and
        hybrid replicas while they are active."""
        if replica_ids:
            records = [self.registry.get(r) for r in replica_ids]   # NOT_FOUND for an unknown one
            cannot = [f"{r.replica_id} ({r.state.value})" for r in records
                      if r.state not in (ReplicaState.ACTIVE, ReplicaState.PAUSED, ReplicaState.SLEEPING)]
            if cannot:
                raise FailedPrecondition(f"only ACTIVE, PAUSED or SLEEPING replicas can receive weights: "
                                         f"{', '.join(cannot)}", reason=Reason.WRONG_REPLICA_STATE)
            return list(replica_ids)
        return [r.replica_id for r in self.registry.replicas(states=[ReplicaState.ACTIVE, ReplicaState.PAUSED])
                if r.kind is ReplicaKind.STANDALONE or self.scheduler.is_hybrid_active]

    async def load_weights(self, path: str, version: int | None, replica_ids: list[str], *, rollback: bool,
                           timeout_s: float | None) -> FlipOutcome:
        """A checkpoint on disk as one fleet-wide version flip (LoadWeights, :mod:`controller.checkpoint_load`):
        ``version`` None is one above the highest version a registered replica serves."""
        targets = self._weight_targets(replica_ids)
        if not targets:
            raise FailedPrecondition("no replica serves to load the checkpoint into", reason=Reason.NO_ELIGIBLE_REPLICA)
        if version is None:
            version = max((r.weight_version for r in self.registry.replicas()), default=0) + 1
        self.emit(EventType.WEIGHT_SYNC_STARTED, weight_version=version, reason="LoadWeights",
                  attributes={"replicas": len(targets), "checkpoint": path[:200]})
        async with self.transitions:
            with self.span("weights.load_checkpoint", weight_version=version, replica_ids=targets,
                           rollback=rollback):
                flip = await self.checkpoints.load(targets, path, version, rollback=rollback,
                                                   timeout_s=timeout_s or self.weights.timeout_s)
        for result in flip.outcome.replica_results:
            if result.ok:
                self.registry.set_weight_version(result.replica_id, version)
            else:
                self.emit(EventType.WEIGHT_SYNC_FAILED, replica_id=result.replica_id, weight_version=version,
                          reason=result.error_message)
        failed = flip.outcome.failed
        self.emit(EventType.WEIGHT_SYNC_COMPLETED, weight_version=version, reason="LoadWeights",
                  attributes={"ok": len(targets) - len(failed), "failed": len(failed),
                              "committed": flip.committed, "rolled_back": flip.rolled_back})
        await self.commit()
        return flip

    async def update_from_group(self, replica_ids: list[str], group_name: str, step: str, body: Any, *,
                                timeout_s: float | None) -> tuple[WeightSyncOutcome, bool]:
        """One step of weights from a trainer's own group (UpdateWeightsFromGroup, :mod:`controller.group_update`):
        ``join`` / ``receive`` / ``leave`` on the listed replicas; the outcome and, for a receive with a
        version, whether it committed."""
        targets = self._weight_targets(replica_ids)
        timeout_s = timeout_s or self.weights.timeout_s
        if step == "join":
            return await self.groups.join(targets, group_name, body, timeout_s), False
        if step == "leave":
            return await self.groups.leave(targets, group_name, timeout_s), False
        version = body.weight_version if body.HasField("weight_version") else None
        self.emit(EventType.WEIGHT_SYNC_STARTED, weight_version=version or 0, reason="UpdateWeightsFromGroup",
                  attributes={"replicas": len(targets), "group": group_name[:64], "tensors": len(body.tensors)})
        async with self.transitions:
            with self.span("weights.receive_from_group", group=group_name[:64], replica_ids=targets):
                outcome, committed = await self.groups.receive(targets, group_name, list(body.tensors), version,
                                                               timeout_s)
        for result in outcome.replica_results:
            if result.ok and version is not None:
                self.registry.set_weight_version(result.replica_id, version)
            elif not result.ok:
                self.emit(EventType.WEIGHT_SYNC_FAILED, replica_id=result.replica_id, weight_version=version or 0,
                          reason=f"{result.error_message}; removed from routing until a sync reaches it")
        self.emit(EventType.WEIGHT_SYNC_COMPLETED, weight_version=version or 0, reason="UpdateWeightsFromGroup",
                  attributes={"ok": len(targets) - len(outcome.failed), "failed": len(outcome.failed)})
        await self.commit()
        return outcome, committed
