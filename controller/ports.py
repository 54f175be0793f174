"""The controller core's routing and replica ports, implemented over gRPC.

``Channels`` holds one channel per peer (from the one channel factory),
``LoadBalancerRouting`` keeps the balancers' routing tables (the configured
ones and those registered with the controller), and
``AgentReplicas`` drives replica agents (one concurrent call per node, each
with a deadline; failures are reported per replica). The weight-sync port,
``WeightBroadcast``, is in :mod:`controller.weight_sync`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import grpc
from opentelemetry.sdk.trace import TracerProvider

from mesh_runtime.channels import ChannelPool, address_list
from mesh_runtime.config import TlsConfig
from rollmesh.common.v1 import types_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc, routing_pb2
from rollmesh.replica.v1 import replica_agent_pb2, replica_agent_pb2_grpc
from rollmesh.weights.v1 import weight_source_pb2_grpc

from .convert import kind_to_proto
from .core.ports import ReplicaCallResult
from .core.records import ReplicaRecord
from .core.replicas import ReplicaRegistry

log = logging.getLogger(__name__)
if TYPE_CHECKING:   # the typed grpc.aio stub exists in the .pyi only
    AgentStub = replica_agent_pb2_grpc.ReplicaAgentServiceAsyncStub



class Channels:
    """One channel (and stub) per peer address, renewed after a certificate rotation; closed at shutdown."""

    def __init__(self, tracer_provider: TracerProvider | None, *, tls: TlsConfig | None = None) -> None:
        self._pool = ChannelPool(tls=tls, tracer_provider=tracer_provider)

    def channel(self, address: str) -> grpc.aio.Channel:
        return self._pool.get(address)

    def agent(self, address: str) -> replica_agent_pb2_grpc.ReplicaAgentServiceAsyncStub:
        return replica_agent_pb2_grpc.ReplicaAgentServiceStub(self.channel(address))

    def weight_source(self, address: str) -> weight_source_pb2_grpc.WeightSourceServiceAsyncStub:
        """The WeightSourceService of the trainer agent or replica agent at ``address``."""
        return weight_source_pb2_grpc.WeightSourceServiceStub(self.channel(address))

    async def close(self) -> None:
        await self._pool.close()


def describe_error(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class OneBalancer:
    """One load balancer's routing table over its gRPC API."""

    def __init__(self, channels: Channels, address: str, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channels.channel(address))

    async def remove_replicas(self, replica_ids: Sequence[str], *, abort_in_flight: bool = False) -> None:
        if replica_ids:
            await self._stub.RemoveReplicas(loadbalancer_pb2.RemoveReplicasRequest(
                replica_ids=list(replica_ids), abort_in_flight=abort_in_flight), timeout=self.timeout_s)

    async def routed(self) -> dict[str, routing_pb2.RoutedReplica]:
        """The balancer's table now, by replica id."""
        reply = await self._stub.ListReplicas(loadbalancer_pb2.ListReplicasRequest(), timeout=self.timeout_s)
        return {r.endpoint.replica_id: r for r in reply.replicas}

    async def add_replicas(self, records: Sequence[ReplicaRecord]) -> None:
        if records:
            endpoints = [routing_pb2.ReplicaEndpoint(replica_id=r.replica_id, address=r.route_address,
                                                     kind=kind_to_proto(r.kind), weight_version=r.weight_version,
                                                     node_id=r.node_id) for r in records]
            await self._stub.AddReplicas(loadbalancer_pb2.AddReplicasRequest(replicas=endpoints),
                                         timeout=self.timeout_s)

    async def update_versions(self, versions: dict[str, int]) -> None:
        if versions:
            updates = [loadbalancer_pb2.ReplicaUpdate(replica_id=r, weight_version=v) for r, v in versions.items()]
            # a replica not routed (a hybrid synced before it wakes) has nothing to update
            await self._stub.UpdateReplicas(loadbalancer_pb2.UpdateReplicasRequest(updates=updates, skip_unknown=True),
                                            timeout=self.timeout_s)

    async def rebalance(self) -> int:
        try:
            reply = await self._stub.Rebalance(loadbalancer_pb2.RebalanceRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:  # fewer than two replicas: nothing to move
                raise
            return 0
        return len(reply.moved_request_ids)

    async def clear_sticky(self) -> None:
        await self._stub.ClearStickySessions(loadbalancer_pb2.ClearStickySessionsRequest(), timeout=self.timeout_s)


class LoadBalancerRouting:
    """``RoutingPort`` over every balancer, configured or registered (a no-op when there is none): each change
    goes to all of them.

    With several balancers, one that cannot be reached does not fail the change (the hybrid step, the scale
    operation): the others have it, and the routing reconciliation brings the missing one in line once it
    answers again (a restarted balancer starts empty and is filled within one ``reconcile_interval_s``). Only
    a change that no balancer took fails. With one balancer its error is the caller's, as before.
    """

    def __init__(self, channels: Channels, address: str, timeout_s: float,
                 registered: Callable[[], Sequence[str]] = lambda: ()) -> None:
        self.address = address
        self.configured = [OneBalancer(channels, a, timeout_s) for a in address_list(address)]
        self._registered = registered
        self._channels = channels
        self._timeout_s = timeout_s
        self._ones: dict[str, OneBalancer] = {b.address: b for b in self.configured}

    @property
    def balancers(self) -> list[OneBalancer]:
        """The configured balancers, then the registered ones (the membership as it is now)."""
        for address in self._registered():
            if address not in self._ones:
                self._ones[address] = OneBalancer(self._channels, address, self._timeout_s)
        return self.configured + [self._ones[a] for a in self._registered()
                                  if a not in {b.address for b in self.configured}]

    async def _all(self, call: Callable[[OneBalancer], Awaitable]) -> list:
        balancers = self.balancers
        results = await asyncio.gather(*(call(b) for b in balancers), return_exceptions=True)
        failed = [(b, r) for b, r in zip(balancers, results) if isinstance(r, BaseException)]
        for balancer, err in failed:
            if isinstance(err, asyncio.CancelledError):
                raise err
            if len(balancers) > 1:
                log.warning("balancer %s missed a routing change (%s); reconciliation brings it in line",
                            balancer.address, describe_error(err))
        if failed and len(failed) == len(balancers):
            raise failed[0][1]
        return [r for r in results if not isinstance(r, BaseException)]

    async def remove_replicas(self, replica_ids: Sequence[str], *, abort_in_flight: bool = False) -> None:
        if replica_ids:
            await self._all(lambda b: b.remove_replicas(replica_ids, abort_in_flight=abort_in_flight))

    async def routed_ids(self) -> set[str] | None:
        """The replica ids in the first balancer's table now (None without a balancer)."""
        routed = await self.routed()
        return None if routed is None else set(routed)

    async def routed(self) -> dict[str, routing_pb2.RoutedReplica] | None:
        """The first balancer's table now, by replica id (None without a balancer)."""
        balancers = self.balancers
        return await balancers[0].routed() if balancers else None

    async def add_replicas(self, records: Sequence[ReplicaRecord]) -> None:
        if records:
            await self._all(lambda b: b.add_replicas(records))

    async def update_versions(self, versions: dict[str, int]) -> None:
        if versions:
            await self._all(lambda b: b.update_versions(versions))

    async def rebalance(self) -> int | None:
        if not self.balancers:
            return None
        return sum(await self._all(lambda b: b.rebalance()))

    async def clear_sticky(self) -> None:
        if self.balancers:
            await self._all(lambda b: b.clear_sticky())


class AgentReplicas:
    """``ReplicaPort`` over the replica agents, grouped by node, one call per replica."""

    def __init__(self, channels: Channels, registry: ReplicaRegistry, timeout_s: float) -> None:
        self.channels = channels
        self.registry = registry
        self.timeout_s = timeout_s

    async def _each(self, replica_ids: Sequence[str],
                    call: Callable[[AgentStub, str], Awaitable]) -> ReplicaCallResult:
        failed: dict[str, str] = {}
        results: list = []

        async def one(replica_id: str) -> None:
            try:
                address = self.registry.get(replica_id).address
                results.append(await asyncio.wait_for(call(self.channels.agent(address), replica_id),
                                                      self.timeout_s))
            except Exception as err:  # noqa: BLE001 - reported per replica
                failed[replica_id] = describe_error(err)

        await asyncio.gather(*(one(r) for r in replica_ids))
        aborted = sum(len(getattr(r, "aborted_request_ids", ())) for r in results)
        return ReplicaCallResult(failed=failed, aborted_requests=aborted)

    async def abort(self, replica_ids: Sequence[str]) -> ReplicaCallResult:
        return await self._each(replica_ids, lambda stub, r: stub.AbortRequests(
            replica_agent_pb2.AbortRequestsRequest(replica_id=r, all=True)))

    async def sleep(self, replica_ids: Sequence[str], level: int) -> ReplicaCallResult:
        return await self._each(replica_ids, lambda stub, r: stub.Sleep(
            replica_agent_pb2.SleepRequest(replica_id=r, level=types_pb2.SleepLevel.ValueType(level),
                                           abort_in_flight=True)))

    async def wake(self, replica_ids: Sequence[str]) -> ReplicaCallResult:
        return await self._each(replica_ids, lambda stub, r: stub.WakeUp(
            replica_agent_pb2.WakeUpRequest(replica_id=r)))

    async def resume(self, replica_ids: Sequence[str]) -> ReplicaCallResult:
        return await self._each(replica_ids, lambda stub, r: stub.ResumeGeneration(
            replica_agent_pb2.ResumeGenerationRequest(replica_ids=[r])))

    async def stop(self, replica_ids: Sequence[str]) -> ReplicaCallResult:
        return await self._each(replica_ids, lambda stub, r: stub.StopReplica(
            replica_agent_pb2.StopReplicaRequest(replica_id=r, force=True)))
