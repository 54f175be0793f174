"""``GroupUpdate``: weights from a trainer's own process group into replicas (the controller's
UpdateWeightsFromGroup; SGLang's ``init_weights_update_group``, ``update_weights_from_distributed`` and
``destroy_weights_update_group`` through the balancer's HTTP front).

Each step runs on every listed replica at once (one call per replica: a broadcast needs every rank in it).
Join gives replica i of the list rank ``rank_offset + i``. A replica that fails to receive holds weights of no
one version, so it is stale and leaves routing until a later sync reaches it; with a ``weight_version`` the
replicas that received serve it and the balancers learn it together (:meth:`WeightBroadcast.push_versions`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from mesh_runtime.durations import set_seconds, to_seconds
from rollmesh.common.v1 import weights_pb2
from rollmesh.replica.v1 import replica_agent_pb2

from .checkpoint_load import PushVersions
from .core.ports import ReplicaSyncOutcome, WeightSyncOutcome
from .core.replicas import ReplicaRegistry
from .ports import Channels, describe_error

class GroupUpdate:
    """See the module docstring."""

    def __init__(self, channels: Channels, registry: ReplicaRegistry, push_versions: PushVersions) -> None:
        self.channels = channels
        self.registry = registry
        self.push_versions = push_versions

    async def join(self, replica_ids: Sequence[str], group_name: str, step: Any, timeout_s: float
                   ) -> WeightSyncOutcome:
        def call(i: int, replica_id: str) -> Awaitable[object]:
            request = replica_agent_pb2.JoinWeightGroupRequest(
                replica_id=replica_id, master_address=step.master_address, master_port=step.master_port,
                rank=step.rank_offset + i, world_size=step.world_size, group_name=group_name, backend=step.backend)
            set_seconds(request.timeout, timeout_s)
            return self._agent(replica_id).JoinWeightGroup(request, timeout=timeout_s + 5)
        return await self._each(replica_ids, group_name, call)

    async def leave(self, replica_ids: Sequence[str], group_name: str, timeout_s: float) -> WeightSyncOutcome:
        def call(i: int, replica_id: str) -> Awaitable[object]:
            return self._agent(replica_id).LeaveWeightGroup(
                replica_agent_pb2.LeaveWeightGroupRequest(replica_id=replica_id, group_name=group_name),
                timeout=timeout_s)
        return await self._each(replica_ids, group_name, call)

    async def receive(self, replica_ids: Sequence[str], group_name: str, tensors: Sequence[weights_pb2.TensorSpec],
                      version: int | None, timeout_s: float) -> tuple[WeightSyncOutcome, bool]:
        """The outcome, and whether ``version`` committed (it serves on every replica that stays routed)."""
        def call(i: int, replica_id: str) -> Awaitable[object]:
            request = replica_agent_pb2.ReceiveGroupWeightsRequest(replica_id=replica_id, group_name=group_name,
                                                                   tensors=tensors)
            if version is not None:
                request.weight_version = version
            set_seconds(request.timeout, timeout_s)
            return self._agent(replica_id).ReceiveGroupWeights(request, timeout=timeout_s + 5)

        def result(reply: object) -> tuple[bool, str, float, int]:
            r = reply.result   # type: ignore[attr-defined]
            return r.checksum_ok, r.error_message, to_seconds(r.duration), r.bytes_received
        outcome = await self._each(replica_ids, group_name, call, result)
        results = list(outcome.replica_results)
        if version is not None:
            await self.push_versions(results, version)   # received: at the version; failed: stale
        elif outcome.failed:
            await self.push_versions([r for r in results if not r.ok], 0)   # stale; the others keep theirs
        outcome = dataclasses.replace(outcome, weight_version=version or 0)
        return outcome, version is not None and any(r.ok for r in results)

    def _agent(self, replica_id: str) -> Any:   # the generated async stub
        return self.channels.agent(self.registry.get(replica_id).address)

    @staticmethod
    async def _each(replica_ids: Sequence[str], group_name: str, call: Callable[[int, str], Awaitable[object]],
                    result: Callable[[object], tuple[bool, str, float, int]] | None = None) -> WeightSyncOutcome:
        started = time.monotonic()

        async def one(i: int, replica_id: str) -> ReplicaSyncOutcome:
            begun = time.monotonic()
            try:
                reply = await call(i, replica_id)
            except grpc.aio.AioRpcError as err:
                return ReplicaSyncOutcome(replica_id, False, describe_error(err), time.monotonic() - begun)
            if result is None:
                return ReplicaSyncOutcome(replica_id, True, "", time.monotonic() - begun)
            ok, why, duration_s, size = result(reply)
            return ReplicaSyncOutcome(replica_id, ok, why, duration_s, size)
        outcomes = await asyncio.gather(*(one(i, r) for i, r in enumerate(replica_ids)))
        return WeightSyncOutcome(weight_version=0, replica_results=tuple(outcomes),
                                 duration_s=time.monotonic() - started, sync_id=f"group-{group_name[:64]}",
                                 source=f"group:{group_name[:64]}")
