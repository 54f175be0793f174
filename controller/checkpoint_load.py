"""``CheckpointFlip``: a checkpoint on disk loaded into replicas as one fleet-wide version flip (the
controller's LoadWeights; SGLang's ``update_weights_from_disk`` through the balancer's HTTP front).

Every replica's node checks the checkpoint against the replica's weights before any replica changes; then the
replicas load it (``LoadCheckpoint`` INSTALL, all nodes at once) and the balancers learn the new versions
together (:meth:`WeightBroadcast.push_versions`: a replica that failed is stale and leaves routing until it
holds the fleet's version). With ``rollback`` the replaced weights are kept on each replica's host until the
flip commits: one failure puts every replica back on what it served before (REVERT) and nothing is pushed; a
replica that cannot go back either leaves routing. When no replica passes the check nothing changes at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

import grpc

from mesh_runtime.durations import to_seconds
from mesh_runtime.errors import FailedPrecondition
from mesh_runtime.reasons import Reason
from rollmesh.replica.v1 import replica_agent_pb2

from .core.ports import ReplicaSyncOutcome, WeightSyncOutcome
from .core.replicas import ReplicaRegistry
from .ports import Channels, describe_error

log = logging.getLogger(__name__)

PushVersions = Callable[[list[ReplicaSyncOutcome], int], Awaitable[None]]


@dataclasses.dataclass(frozen=True)
class FlipOutcome:
    outcome: WeightSyncOutcome
    committed: bool
    rolled_back: bool


class CheckpointFlip:
    """See the module docstring. ``push_versions`` tells the balancers who holds which version."""

    def __init__(self, channels: Channels, registry: ReplicaRegistry, push_versions: PushVersions) -> None:
        self.channels = channels
        self.registry = registry
        self.push_versions = push_versions

    async def load(self, replica_ids: Sequence[str], path: str, version: int, *, rollback: bool,
                   timeout_s: float) -> FlipOutcome:
        started = time.monotonic()
        update_id = f"load-{version}-{uuid.uuid4().hex[:8]}"
        step = replica_agent_pb2.CheckpointStep

        async def run(ids: Sequence[str], which: replica_agent_pb2.CheckpointStep.ValueType
                      ) -> dict[str, ReplicaSyncOutcome]:
            return await self._step(ids, which, path=path, version=version, update_id=update_id,
                                    keep_previous=rollback, timeout_s=timeout_s)

        checked = await run(replica_ids, step.CHECKPOINT_STEP_CHECK)
        fit = [r for r in replica_ids if checked[r].ok]
        if not fit:
            first = checked[replica_ids[0]].error_message
            raise FailedPrecondition(f"no replica can load checkpoint {path[:200]}: {first} (nothing changed)",
                                     reason=Reason.CHECKPOINT_MISMATCH)
        failed = {r: checked[r] for r in replica_ids if not checked[r].ok}
        if failed and rollback:
            why = _rolled_back_because(failed)
            results = [failed.get(r) or ReplicaSyncOutcome(r, False, why) for r in replica_ids]
            return self._done(results, version, started, update_id, committed=False, rolled_back=True)
        installed = await run(fit, step.CHECKPOINT_STEP_INSTALL)
        failed |= {r: o for r, o in installed.items() if not o.ok}
        if failed and rollback:
            done = [r for r in fit if installed[r].ok]
            reverted = await run(done, step.CHECKPOINT_STEP_REVERT) if done else {}
            why = _rolled_back_because(failed)
            stuck = {r: ReplicaSyncOutcome(r, False, f"{why}; could not go back: {o.error_message}")
                     for r, o in reverted.items() if not o.ok}
            if stuck:   # neither version for sure: out of routing until a later sync reaches it
                await self.push_versions(list(stuck.values()), version)
            results = [failed.get(r) or stuck.get(r) or ReplicaSyncOutcome(r, False, why) for r in replica_ids]
            log.warning("checkpoint %s as version %d rolled back on %d replica(s)%s", path, version,
                        len(done) - len(stuck), f"; {sorted(stuck)} left routing" if stuck else "")
            return self._done(results, version, started, update_id, committed=False, rolled_back=True)
        results = [failed.get(r) or installed[r] for r in replica_ids]
        await self.push_versions(results, version)
        if rollback:
            await run(fit, step.CHECKPOINT_STEP_RELEASE)
        return self._done(results, version, started, update_id, committed=True, rolled_back=False)

    async def _step(self, replica_ids: Sequence[str], which: replica_agent_pb2.CheckpointStep.ValueType, *,
                    path: str, version: int, update_id: str, keep_previous: bool,
                    timeout_s: float) -> dict[str, ReplicaSyncOutcome]:
        """One step on every listed replica, one call per node, all nodes at once; a node that fails the call
        fails its replicas."""
        by_node: dict[str, list[str]] = {}
        for replica_id in replica_ids:
            by_node.setdefault(self.registry.get(replica_id).address, []).append(replica_id)

        async def node(address: str, ids: list[str]) -> list[ReplicaSyncOutcome]:
            request = replica_agent_pb2.LoadCheckpointRequest(
                replica_ids=ids, checkpoint_path=path, weight_version=version, step=which, update_id=update_id,
                keep_previous=keep_previous)
            try:
                reply = await self.channels.agent(address).LoadCheckpoint(request, timeout=timeout_s)
            except grpc.aio.AioRpcError as err:
                why = f"LoadCheckpoint on {address}: {describe_error(err)}"
                return [ReplicaSyncOutcome(r, False, why) for r in ids]
            return [ReplicaSyncOutcome(r.replica_id, r.checksum_ok, r.error_message, to_seconds(r.duration),
                                       r.bytes_received) for r in reply.results]

        outcomes = await asyncio.gather(*(node(a, ids) for a, ids in by_node.items()))
        return {o.replica_id: o for group in outcomes for o in group}

    @staticmethod
    def _done(results: list[ReplicaSyncOutcome], version: int, started: float, update_id: str, *, committed: bool,
              rolled_back: bool) -> FlipOutcome:
        outcome = WeightSyncOutcome(weight_version=version, replica_results=tuple(results),
                                    duration_s=time.monotonic() - started, sync_id=update_id,
                                    source="checkpoint")
        return FlipOutcome(outcome, committed, rolled_back)


def _rolled_back_because(failed: dict[str, ReplicaSyncOutcome]) -> str:
    first = next(iter(failed.values()))
    return (f"rolled back: {len(failed)} replica(s) could not load the checkpoint "
            f"({first.replica_id}: {first.error_message})")
