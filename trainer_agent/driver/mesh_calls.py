"""The driver's calls to the mesh besides the step protocol (:class:`trainer_client.steps.StepProtocol`): the
routed-replica count, a reachability probe and the resync of replicas a step's broadcast left behind."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from mesh_runtime.net import AddressError, parse_host_port
from mesh_runtime.retry import RetryPolicy
from rollmesh.common.v1 import types_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2

log = logging.getLogger(__name__)
GONE_STATES = frozenset({types_pb2.REPLICA_STATE_FAILED, types_pb2.REPLICA_STATE_STOPPED,
                         types_pb2.REPLICA_STATE_REMOVED})
"""ReplicaState values of replicas that no longer take part (FAILED, STOPPED, REMOVED)."""


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


class _StillPending(Exception):
    """A resync pass left replicas without the step's version (the next pass tries them again)."""


async def resync_replicas(controller: Any, gs: int, version: int, replica_ids: list[str], *, rpc_timeout: float,
                          sync_timeout: float) -> list[str]:
    """Sync standalone replicas whose part of the step's broadcast failed again, one per group.

    The controller already reruns a broadcast without agents it cannot
    reach; what is left for this pass is a receiver that joined and then
    died mid-transfer (its lease not yet expired), which fails the whole
    group, so the healthy replicas miss the version too and leave routing.
    Syncing each replica on its own brings the healthy ones back. A replica whose agent does not accept a
    connection is not synced (its broadcast would wait for a receiver that
    never comes); it is given up once the controller no longer lists it as
    live (its lease expired), and every replica after ``sync_timeout``.
    Returns the replicas that now hold ``version``.
    """
    from rollmesh.controller.v1 import registry_pb2, weight_sync_pb2

    pending, done, attempt = list(replica_ids), [], 0

    async def one_pass() -> None:
        nonlocal attempt
        attempt += 1
        listed = await controller.ListReplicas(registry_pb2.ListReplicasRequest(), timeout=rpc_timeout)
        live = {r.replica_id: r.address for r in listed.replicas if r.state not in GONE_STATES}
        pending[:] = [rid for rid in pending if rid in live]
        for rid in list(pending):
            if live[rid] and not await accepts_connections(live[rid]):
                continue
            try:
                reply = await controller.SyncWeights(weight_sync_pb2.SyncWeightsRequest(
                    weight_version=version, replica_ids=[rid], request_id=f"resync-{gs}-{rid}-{attempt}"),
                    timeout=sync_timeout)
            except grpc.aio.AioRpcError as err:
                if err.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    raise
                # lost since it was listed (lease expired, removed): the controller keeps it out of routing
                log.info("step %d: %s is no longer syncable (%s); not resyncing it", gs, rid, err.details())
                pending.remove(rid)
                continue
            if any(r.ok for r in reply.result.replica_results):
                pending.remove(rid)
                done.append(rid)
        if pending:
            raise _StillPending(pending)

    if pending:
        policy = RetryPolicy(initial_s=0.25, max_s=2.0, within_s=sync_timeout)
        with contextlib.suppress(_StillPending):   # given up after sync_timeout
            await policy.run(one_pass, retry_if=lambda err: isinstance(err, _StillPending))
    return done
