"""Channels from the balancer to replica agents, one per agent address."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from mesh_runtime.channels import ChannelPool
from mesh_runtime.config import TlsConfig
from mesh_runtime.rpc_tracing import context_metadata
from rollmesh.replica.v1 import replica_agent_pb2, replica_agent_pb2_grpc

from . import multiplex
from .table import Route

if TYPE_CHECKING:   # the typed grpc.aio stub exists in the .pyi only
    AgentStub = replica_agent_pb2_grpc.ReplicaAgentServiceAsyncStub

log = logging.getLogger(__name__)


class Upstreams:
    """Stubs of the replica agents the balancer routes to (channels shared per address)."""

    def __init__(self, *, tracer_provider: TracerProvider | None, call_timeout_s: float,
                 tls: TlsConfig | None = None, agent_streams: bool = True) -> None:
        self._pool = ChannelPool(tls=tls, tracer_provider=tracer_provider)
        self._call_timeout_s = call_timeout_s
        self._stubs: dict[str, tuple[grpc.aio.Channel, AgentStub]] = {}
        self._untraced_stubs: dict[str, tuple[grpc.aio.Channel, AgentStub]] = {}
        self._streams = multiplex.agent_streams(self._untraced) if agent_streams else None

    def stub(self, address: str) -> replica_agent_pb2_grpc.ReplicaAgentServiceAsyncStub:
        channel = self._pool.get(address)   # a new one after a certificate rotation
        cached = self._stubs.get(address)
        if cached is None or cached[0] is not channel:
            cached = self._stubs[address] = (channel, replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel))
        return cached[1]

    def generate(self, route: Route, request: replica_agent_pb2.GenerateRequest,
                 timeout_s: float | None) -> grpc.aio.UnaryStreamCall:
        """Start a generation on the route's agent (sent now); returns its call (an async iterator of the
        agent's messages, with ``cancel()``). A traced attempt is a Generate call of its own, with its client
        span. An untraced one goes on the agent's GenerateMany stream (:mod:`.multiplex`; with
        ``agent_streams`` off, a Generate call on the channel without client interceptors); its trace context
        still travels, so the agent follows the same sampling decision."""
        if trace.get_current_span().is_recording():
            return self.stub(route.address).Generate(request, timeout=timeout_s)
        metadata = context_metadata()
        untraced = self._untraced(route.address)
        if self._streams is None:
            return untraced.Generate(request, timeout=timeout_s, metadata=metadata)
        return self._streams.generate(route.address, request, timeout_s, dict(metadata),
                                      lambda: untraced.Generate(request, timeout=timeout_s, metadata=metadata))

    def _untraced(self, address: str) -> replica_agent_pb2_grpc.ReplicaAgentServiceAsyncStub:
        channel = self._pool.get(address, traced=False)
        cached = self._untraced_stubs.get(address)
        if cached is None or cached[0] is not channel:
            cached = self._untraced_stubs[address] = (channel, replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel))
        return cached[1]

    async def abort(self, route: Route, request_ids: list[str]) -> list[str]:
        """Ask the route's agent to abort requests; failures are logged, not raised."""
        if not request_ids:
            return []
        try:
            reply = await self.stub(route.address).AbortRequests(
                replica_agent_pb2.AbortRequestsRequest(
                    replica_id=route.replica_id, requests=replica_agent_pb2.RequestIds(request_ids=request_ids)),
                timeout=self._call_timeout_s)
        except grpc.aio.AioRpcError as err:
            log.warning("abort of %d request(s) on %s failed: %s %s", len(request_ids), route.replica_id,
                        err.code().name, err.details())
            return []
        return list(reply.aborted_request_ids)

    async def flush_cache(self, route: Route) -> str:
        """Ask the route's agent to flush the replica's prefix cache; "" when it did, else why not."""
        try:
            await self.stub(route.address).FlushCache(
                replica_agent_pb2.FlushCacheRequest(replica_ids=[route.replica_id]), timeout=self._call_timeout_s)
        except grpc.aio.AioRpcError as err:
            return f"{err.code().name}: {(err.details() or '')[:300]}"
        return ""

    async def close_session(self, route: Route, session_id: str) -> bool:
        """Tell the route's agent that a session ended; whether its engine released anything (a failure is
        logged and counts as nothing released: the engine's own idle expiry still frees it)."""
        try:
            reply = await self.stub(route.address).CloseSession(
                replica_agent_pb2.CloseSessionRequest(replica_id=route.replica_id, session_id=session_id),
                timeout=self._call_timeout_s)
        except grpc.aio.AioRpcError as err:
            log.warning("CloseSession of a session on %s failed: %s %s", route.replica_id, err.code().name,
                        err.details())
            return False
        return reply.released

    async def close(self) -> None:
        if self._streams is not None:
            await self._streams.close()
        await self._pool.close()
        self._stubs.clear()
        self._untraced_stubs.clear()
