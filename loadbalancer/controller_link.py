"""The balancer's side of the controller's balancer registry: register, renew, deregister at shutdown.

With ``controller_address`` set, the balancer calls ``RegisterBalancer`` at start and again every
``heartbeat_interval`` the controller answers (its lease); the controller then keeps this balancer's routing
table in line and lists it to clients (``ListBalancers``) once the table is filled. A controller that cannot
be reached is tried again with jittered backoff (with several controller addresses the channel follows the
leader); a refusal (a bad or taken address, a certificate for another balancer) is logged as an error and
retried ever more slowly, since an operator's fix of the other side heals it: the replica agents' loop,
:func:`mesh_runtime.registration.keep_registered`. At shutdown it deregisters, so no client keeps choosing
a balancer that is gone until its lease runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

import grpc

from mesh_runtime.durations import to_seconds
from mesh_runtime.registration import LinkLost, keep_registered
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2

log = logging.getLogger(__name__)


class BalancerLink:
    """Keeps one balancer registered with the controller while it runs."""

    def __init__(self, channel: grpc.aio.Channel, *, balancer_id: str, address: str, version: str,
                 call_timeout_s: float = 5.0, max_backoff_s: float = 5.0) -> None:
        self._stub = controller_pb2_grpc.ControllerServiceStub(channel)
        self.request = registry_pb2.RegisterBalancerRequest(balancer_id=balancer_id, address=address,
                                                            version=version, instance_id=secrets.token_hex(8))
        self._call_timeout_s = call_timeout_s
        self._max_backoff_s = max_backoff_s
        self.interval_s = 1.0
        self.registered = asyncio.Event()
        self.routing_ready = False

    async def run(self) -> None:
        """Register, then renew every heartbeat interval, until cancelled."""
        await keep_registered(self._session, what=f"balancer {self.request.balancer_id}'s registration",
                              max_backoff_s=self._max_backoff_s)

    async def _session(self) -> None:
        renewed = False
        while True:
            try:
                reply = await self._stub.RegisterBalancer(self.request, timeout=self._call_timeout_s)
            except grpc.aio.AioRpcError as err:
                self.registered.clear()   # (not on cancellation: the shutdown's deregister needs it set)
                raise LinkLost.from_rpc("RegisterBalancer failed", err, registered=renewed) from None
            renewed = True
            seconds = to_seconds(reply.heartbeat_interval)
            if seconds > 0:
                self.interval_s = seconds
            if not self.registered.is_set():
                log.info("registered balancer %s at %s with the controller (heartbeat every %.2f s)",
                         self.request.balancer_id, self.request.address, self.interval_s)
            self.registered.set()
            self.routing_ready = reply.routing_ready
            await asyncio.sleep(self.interval_s)

    async def deregister(self, reason: str = "balancer shutdown") -> None:
        """Leave the controller's set now (best effort: an unreachable controller lets the lease run out)."""
        if not self.registered.is_set():
            return
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await self._stub.DeregisterBalancer(registry_pb2.DeregisterBalancerRequest(
                balancer_id=self.request.balancer_id, reason=reason), timeout=1.0)
            log.info("deregistered balancer %s from the controller", self.request.balancer_id)
