"""A generation client's balancers, read from the controller: the set a consistent-hash ring spreads over.

Balancers that register with the controller (``controller_address`` in their config) are listed by
``ListBalancers``, with ``routing_ready`` once the controller has filled their table. A client given no
balancer address opens :func:`open_discovered_balancers`: a :class:`~mesh_runtime.hash_ring.HashRingChannel`
over the ready balancers, whose membership a background task refreshes every ``refresh_s`` from the
controller (any controller: standbys answer it from their copy of the store). A balancer that joins takes
about 1/N of the request ids; one that leaves (deregistered, lease lapsed, not answering the controller)
hands its ids to the next balancer of the ring. While the controller cannot be reached, or lists no ready
balancer, the ring keeps the set it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence

import grpc
from opentelemetry.sdk.trace import TracerProvider

from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2

from .channels import OpenOne, open_channel
from .hash_ring import HashRingChannel
from .config import TlsConfig

log = logging.getLogger(__name__)


async def ready_balancers(controller: controller_pb2_grpc.ControllerServiceAsyncStub, *,
                          timeout_s: float = 5.0) -> list[str]:
    """Addresses of the balancers the controller lists as ready, in its order (by balancer id)."""
    reply = await controller.ListBalancers(registry_pb2.ListBalancersRequest(ready_only=True), timeout=timeout_s)
    return [b.address for b in reply.balancers]


class DiscoveredBalancers(HashRingChannel):
    """A :class:`HashRingChannel` whose balancers are the controller's ready ones, refreshed in the background."""

    def __init__(self, addresses: Sequence[str], open_one: OpenOne, controller_channel: grpc.aio.Channel, *,
                 refresh_s: float, owns_controller_channel: bool) -> None:
        super().__init__(addresses, open_one)
        self._controller_channel = controller_channel
        self._owns = owns_controller_channel
        self._controller = controller_pb2_grpc.ControllerServiceStub(controller_channel)
        self.refresh_s = refresh_s
        self._refresher = asyncio.ensure_future(self._refresh_forever())

    async def refresh(self) -> bool:
        """Read the set once; True when it changed."""
        addresses = await ready_balancers(self._controller)
        if not addresses:
            log.warning("the controller lists no ready balancer; keeping %s", self.addresses)
            return False
        if addresses == self.addresses:
            return False
        log.info("balancers: %s -> %s", self.addresses, addresses)
        self.set_addresses(addresses)
        return True

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except grpc.aio.AioRpcError as err:   # the controller is away: the set stays as it is
                log.info("reading the balancers from the controller failed (%s); keeping %s", err.code().name,
                         self.addresses)

    async def close(self, grace: float | None = None) -> None:
        self._refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._refresher
        await super().close(grace)
        if self._owns:
            await self._controller_channel.close()


async def open_discovered_balancers(controller_address: str, *, tls: TlsConfig | None = None,
                                    tracer_provider: TracerProvider | None = None,
                                    idempotent: Sequence[tuple[str, str]] = (), refresh_s: float = 2.0,
                                    timeout_s: float = 60.0) -> DiscoveredBalancers:
    """A ring over the balancers registered with the controller(s) at ``controller_address``; waits up to
    ``timeout_s`` for the first ready one (``TimeoutError`` naming what it saw when none comes)."""
    from .channels import read_methods  # noqa: PLC0415

    controller_channel = open_channel(controller_address, tls=tls, tracer_provider=tracer_provider,
                                      idempotent=read_methods())
    stub = controller_pb2_grpc.ControllerServiceStub(controller_channel)
    deadline, last = time.monotonic() + timeout_s, "no answer yet"
    try:
        while True:
            try:
                addresses = await ready_balancers(stub)
                if addresses:
                    break
                last = "the controller lists no ready balancer"
            except grpc.aio.AioRpcError as err:
                last = f"ListBalancers: {err.code().name}: {err.details()}"
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no ready load balancer registered with the controller at "
                                   f"{controller_address[:120]} within {timeout_s:g} s ({last})")
            await asyncio.sleep(0.25)
    except BaseException:
        await controller_channel.close()
        raise
    open_one = functools.partial(open_channel, tls=tls, tracer_provider=tracer_provider, idempotent=idempotent)
    return DiscoveredBalancers(addresses, open_one, controller_channel, refresh_s=refresh_s,
                               owns_controller_channel=True)
