"""Status probes of the servers the controller calls, over its shared channels."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc

from rollmesh.controller.v1 import controller_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc

from .ports import Channels


class Peers:
    """Probes each peer (every balancer, configured or registered) with GetStatus."""

    def __init__(self, *, balancers: Callable[[], Sequence[str]], timeout_s: float, channels: Channels) -> None:
        self.timeout_s = timeout_s
        self.balancers = balancers
        self._channels = channels

    async def probe(self) -> list[controller_pb2.PeerStatus]:
        """Ask each peer for its status, each call bounded by ``timeout_s``."""
        peers = []
        for address in self.balancers():   # each of several balancers
            peer = controller_pb2.PeerStatus(role="lb", address=address)
            stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(self._channels.channel(address))
            try:
                reply = await stub.GetStatus(loadbalancer_pb2.GetStatusRequest(), timeout=self.timeout_s)
            except grpc.aio.AioRpcError as err:
                peer.reachable = False
                peer.error = f"{err.code().name}: {err.details()}"
            else:
                peer.reachable = True
                peer.status.CopyFrom(reply.status)
            peers.append(peer)
        return peers
