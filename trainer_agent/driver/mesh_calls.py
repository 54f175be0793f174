"""The driver's calls to the mesh besides the step protocol (:class:`trainer_client.steps.StepProtocol`): the
routed-replica count and a reachability probe."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from mesh_runtime.net import AddressError, parse_host_port
from rollmesh.loadbalancer.v1 import loadbalancer_pb2


ReplicaCount = Callable[[], Awaitable[int]]


def lb_replica_count(lb_stub: Any, *, timeout_s: float = 10.0) -> ReplicaCount:
    """``await count()`` = the replicas the load balancer routes to now."""
    async def count() -> int:
        reply = await lb_stub.ListReplicas(loadbalancer_pb2.ListReplicasRequest(), timeout=timeout_s)
        return len(reply.replicas)
    return count


async def accepts_connections(address: str, timeout_s: float = 2.0) -> bool:
    """Whether the server at ``address`` accepts a TCP connection within ``timeout_s`` (plaintext or TLS)."""
    try:
        host, port = parse_host_port(address)
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (TimeoutError, OSError, AddressError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True
