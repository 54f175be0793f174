"""The driver's calls to the mesh: the step protocol's retried calls, the routed-replica count, a reachability probe."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from mesh_runtime.durations import duration  # noqa: F401 - re-exported to the driver loop
from mesh_runtime.net import AddressError, parse_host_port
from mesh_runtime.retry import call_again
from rollmesh.loadbalancer.v1 import loadbalancer_pb2

log = logging.getLogger("trainer_agent.driver.loop")   # the step protocol's retries log as the loop's

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


async def step_call(method: Callable[..., Awaitable[Any]], request: Any, *, timeout_s: float,
                    backoff_s: float = 0.2, max_backoff_s: float = 2.0) -> Any:
    """One call of the step protocol, repeated while the controller cannot answer it, until ``timeout_s`` has
    passed (:func:`~mesh_runtime.retry.call_again`, the loop ``trainer_client.MeshClient`` uses too).

    The controller answers a repeated call for the current step with the
    answer it recorded (and stored before replying), so a retry after a
    controller restart is safe. Bounded exponential backoff (or the wait the
    controller asks for); each attempt's deadline is what remains of
    ``timeout_s``. Any status no repeat can fix is raised at once.
    """
    def told(err: grpc.RpcError, wait: float) -> None:
        details = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
        log.warning("step protocol: the controller is unavailable (%s); retrying in %.2f s", details, wait)

    return await call_again(lambda timeout: method(request, timeout=timeout), within_s=timeout_s,
                            backoff_s=backoff_s, max_backoff_s=max_backoff_s, on_retry=told)
