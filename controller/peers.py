"""Channels from the controller to the other servers, and their status probes."""

from __future__ import annotations

import grpc
from opentelemetry.sdk.trace import TracerProvider

from mesh_runtime.channels import open_channel
from rollmesh.controller.v1 import controller_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc

_LB_SERVICE = "rollmesh.loadbalancer.v1.LoadBalancerService"


class Peers:
    """The controller's clients of its peers; closed at shutdown."""

    def __init__(self, *, load_balancer_address: str, timeout_s: float,
                 tracer_provider: TracerProvider | None) -> None:
        self.timeout_s = timeout_s
        self.load_balancer_address = load_balancer_address
        self._lb_channel = (open_channel(load_balancer_address, tracer_provider=tracer_provider,
                                         idempotent=[(_LB_SERVICE, "GetStatus")])
                            if load_balancer_address else None)
        self.load_balancer = (loadbalancer_pb2_grpc.LoadBalancerServiceStub(self._lb_channel)
                              if self._lb_channel else None)

    async def probe(self) -> list[controller_pb2.PeerStatus]:
        """Ask each configured peer for its status, each call bounded by ``timeout_s``."""
        peers = []
        if self.load_balancer is not None:
            peer = controller_pb2.PeerStatus(role="lb", address=self.load_balancer_address)
            try:
                reply = await self.load_balancer.GetStatus(loadbalancer_pb2.GetStatusRequest(),
                                                           timeout=self.timeout_s)
            except grpc.aio.AioRpcError as err:
                peer.reachable = False
                peer.error = f"{err.code().name}: {err.details()}"
            else:
                peer.reachable = True
                peer.status.CopyFrom(reply.status)
            peers.append(peer)
        return peers

    async def close(self) -> None:
        if self._lb_channel is not None:
            await self._lb_channel.close()
