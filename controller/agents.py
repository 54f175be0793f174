"""The replica-agent and load-balancer calls that scale operations make, each with a deadline.

Thin wrappers over the generated stubs on the controller's shared channels:
launching, inspecting, draining and stopping one replica at an address, an
agent's identity and load reports (external nodes), and which replicas the
load balancer routes. Failures surface as ``grpc.aio.AioRpcError`` or
``TimeoutError``; :func:`why` renders either for an operation's error message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc

from rollmesh.common.v1 import types_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc
from rollmesh.replica.v1 import replica_agent_pb2 as pb
from rollmesh.replica.v1 import replica_pb2

from .convert import duration
from .ports import Channels


def why(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    if isinstance(err, (TimeoutError, asyncio.TimeoutError)):
        return "DEADLINE_EXCEEDED: no answer in time"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class AgentCalls:
    """Calls to replica agents and the balancer on behalf of scale operations."""

    def __init__(self, channels: Channels, *, timeout_s: float, balancers: Callable[[], Sequence[str]]) -> None:
        self.channels = channels
        self.timeout_s = timeout_s
        self.balancers = balancers
        """The addresses of the balancers now (configured and registered)."""

    async def status(self, address: str) -> pb.GetStatusResponse:
        return await self.channels.agent(address).GetStatus(pb.GetStatusRequest(), timeout=self.timeout_s)

    async def replicas(self, address: str) -> list:
        reply = await self.channels.agent(address).ListReplicas(pb.ListReplicasRequest(), timeout=self.timeout_s)
        return list(reply.replicas)

    async def launch(self, address: str, replica_id: str, *, slots: int, request_id: str, timeout_s: float,
                     engine_url: str = "") -> replica_pb2.Replica:
        reply = await self.channels.agent(address).LaunchReplica(
            pb.LaunchReplicaRequest(replica_id=replica_id, kind=types_pb2.REPLICA_KIND_STANDALONE, slots=slots,
                                    request_id=request_id, engine_url=engine_url), timeout=timeout_s)
        return reply.replica

    async def replica(self, address: str, replica_id: str) -> replica_pb2.Replica:
        reply = await self.channels.agent(address).GetReplica(pb.GetReplicaRequest(replica_id=replica_id),
                                                              timeout=self.timeout_s)
        return reply.replica

    async def in_flight(self, address: str, replica_id: str) -> int:
        return (await self.replica(address, replica_id)).in_flight_requests

    async def abort_all(self, address: str, replica_id: str) -> int:
        reply = await self.channels.agent(address).AbortRequests(
            pb.AbortRequestsRequest(replica_id=replica_id, all=True), timeout=self.timeout_s)
        return len(reply.aborted_request_ids)

    async def stop(self, address: str, replica_id: str, *, grace_s: float, force: bool) -> None:
        request = pb.StopReplicaRequest(replica_id=replica_id, force=force, grace=duration(grace_s))
        await self.channels.agent(address).StopReplica(request, timeout=grace_s + self.timeout_s)

    async def load_reports(self, address: str) -> list:
        reply = await self.channels.agent(address).GetLoadReports(pb.GetLoadReportsRequest(),
                                                                  timeout=self.timeout_s)
        return list(reply.reports)

    async def routed(self) -> set[str] | None:
        """Replica ids the balancer routes to now (the first of several that answers); None when there is no
        balancer."""
        addresses = list(self.balancers())
        for index, address in enumerate(addresses):
            stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(self.channels.channel(address))
            try:
                reply = await stub.ListReplicas(loadbalancer_pb2.ListReplicasRequest(), timeout=self.timeout_s)
            except grpc.aio.AioRpcError:
                if index == len(addresses) - 1:
                    raise
                continue   # a balancer that is down: the next one's table is the same routing
            return {r.endpoint.replica_id for r in reply.replicas if r.routable}
        return None
