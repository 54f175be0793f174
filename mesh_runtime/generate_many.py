"""A generation client's calls to its balancers, on ``GenerateMany`` streams where the balancers serve them.

:class:`BalancerGenerations` is what a client that sends many generations
(the trainer's rollouter) calls instead of ``LoadBalancerService/Generate``:
:meth:`BalancerGenerations.call` returns something read exactly like that
call (an async iterator of ``GenerateResponse`` that raises
``grpc.aio.AioRpcError``; ``cancel()``), but the generation travels on one
``GenerateMany`` stream per balancer (:mod:`mesh_runtime.multiplex`), so
neither side pays a call per request. Over several balancers (a
:class:`~mesh_runtime.hash_ring.HashRingChannel`) a request goes to the first
balancer of its id's ring order, as a ``Generate`` call would; a stream that
breaks marks its balancer down in the ring, so the caller's retry of the same
id goes to the next one. A balancer that does not serve ``GenerateMany`` (an
older one) gets ``Generate`` calls, as do all until its capability is known.
"""

from __future__ import annotations

from typing import Any

import grpc

from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc

from .hash_ring import HashRingChannel, ring_key
from .multiplex import StreamPool, serves_generate_many
from .rpc_tracing import context_metadata


class BalancerGenerations:
    """Generations through ``channel`` (one balancer's, or a ring of them); see the module docstring."""

    def __init__(self, channel: Any, *, metadata: Any = None, probe_timeout_s: float = 10.0) -> None:
        self._channel = channel
        self._ring = channel if isinstance(channel, HashRingChannel) else None
        self._metadata = tuple(metadata or ())
        self._stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
        self._pool = StreamPool(
            open_call=lambda address: self._stub_at(address).GenerateMany,
            probe=lambda address: serves_generate_many(self._stub_at(address), pb.GetStatusRequest(),
                                                       probe_timeout_s),
            action=pb.GenerateManyAction, request=pb.GenerateManyRequest, what="balancer",
            on_broken=self._broken)

    def _stub_at(self, address: str) -> loadbalancer_pb2_grpc.LoadBalancerServiceAsyncStub:
        if self._ring is None:
            return self._stub
        return loadbalancer_pb2_grpc.LoadBalancerServiceStub(self._ring.channel(address))

    def _broken(self, address: str, error: grpc.aio.AioRpcError) -> None:
        if self._ring is not None:
            self._ring.observe(error, address)

    def call(self, request: pb.GenerateRequest, *, timeout_s: float | None = None) -> Any:
        """Start ``request`` (sent now); read the result as from a ``Generate`` call."""
        address = self._ring.order(ring_key(request))[0] if self._ring is not None else ""
        trace = context_metadata()
        metadata = self._metadata + trace

        def generate_call() -> Any:
            return self._stub.Generate(request, timeout=timeout_s, metadata=metadata or None)
        return self._pool.generate(address, request, timeout_s, dict(trace), generate_call)

    async def check(self, address: str = "") -> bool:
        """Probe the balancer at ``address`` (of the ring; ``""`` for a single balancer's channel) now and say
        whether its generations go on a stream."""
        return await self._pool.check(address)

    async def close(self) -> None:
        """Close the streams (not the channel)."""
        await self._pool.close()
