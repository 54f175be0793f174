"""The driver's calls to the mesh: the step protocol's retried calls, the routed-replica count, a reachability probe."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from mesh_runtime.durations import duration
from mesh_runtime.net import AddressError, parse_host_port
from mesh_runtime.retry import retry_same
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
    """One call of the step protocol, retried while :func:`~mesh_runtime.retry.retry_same` says so (``UNAVAILABLE``)
    until ``timeout_s`` has passed.

    The controller answers a repeated call for the current step with the
    answer it recorded (and stored before replying), so a retry after a
    controller restart is safe. Bounded exponential backoff; the last
    attempt's deadline is what remains of ``timeout_s``. Any other status is
    raised at once.
    """
    deadline = time.monotonic() + timeout_s

    retrying = AsyncRetrying(retry=retry_if_exception(retry_same), reraise=True,
                             stop=stop_after_delay(timeout_s),
                             wait=wait_exponential(multiplier=backoff_s, max=max_backoff_s),
                             before_sleep=lambda state: log.warning(
                                 "step protocol: the controller is unavailable (%s); retrying",
                                 _detail(state.outcome.exception() if state.outcome else None)))
    async for attempt in retrying:
        with attempt:
            return await method(request, timeout=max(0.5, deadline - time.monotonic()))
    raise AssertionError("unreachable")  # pragma: no cover - reraise=True ends the loop with the error


def _detail(err: BaseException | None) -> str:
    return err.details() or "" if isinstance(err, grpc.aio.AioRpcError) else str(err)
