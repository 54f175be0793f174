"""The agent's side of the controller registry: register, then hold a lease.

The agent registers its node and replicas, then pushes load reports on a
bidirectional stream at the interval the controller sets (the Envoy
load-reporting pattern). When the stream breaks (controller restart, network)
it re-registers by itself (:func:`mesh_runtime.registration.keep_registered`, the balancer's loop too).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf import duration_pb2

from mesh_runtime.durations import to_seconds
from mesh_runtime.registration import LinkLost, keep_registered
from rollmesh.common.v1 import load_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2

log = logging.getLogger(__name__)


class ControllerLink:
    """Keeps this node registered with the controller for as long as it runs."""

    def __init__(self, *, channel: grpc.aio.Channel | Callable[[], grpc.aio.Channel],
                 registration: Callable[[], registry_pb2.RegisterNodeRequest],
                 reports: Callable[[], list[load_pb2.LoadReport]],
                 on_rejected: Callable[[list[str]], Awaitable[None] | None] | None = None,
                 call_timeout_s: float = 10.0, max_backoff_s: float = 5.0) -> None:
        # a callable gives the channel of each (re)registration: a new one after a certificate rotation
        self._channel = channel if not isinstance(channel, grpc.aio.Channel) else (lambda: channel)
        self._stub_channel = self._channel()
        self._stub = controller_pb2_grpc.ControllerServiceStub(self._stub_channel)
        self._registration = registration
        self._reports = reports
        self._on_rejected = on_rejected
        self._call_timeout_s = call_timeout_s
        self._max_backoff_s = max_backoff_s
        self.interval_s = 1.0
        self.registrations = 0
        self.registered = asyncio.Event()

    async def run(self) -> None:
        """Register and report forever; cancelled at shutdown."""
        await keep_registered(self._session, what="the node's registration", max_backoff_s=self._max_backoff_s)

    async def _session(self) -> None:
        channel = self._channel()
        if channel is not self._stub_channel:
            self._stub_channel, self._stub = channel, controller_pb2_grpc.ControllerServiceStub(channel)
        request = self._registration()
        try:
            reply = await self._stub.RegisterNode(request, timeout=self._call_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise LinkLost.from_rpc("RegisterNode failed", err) from None
        self.registrations += 1
        self._set_interval(reply.load_report_interval)
        if reply.rejected_replica_ids and self._on_rejected is not None:
            result = self._on_rejected(list(reply.rejected_replica_ids))
            if result is not None:
                await result
        log.info("registered node %s with the controller (%d replicas, report every %.2f s)",
                 request.node_id, len(request.replicas), self.interval_s)
        self.registered.set()
        call = self._stub.StreamLoadReports(self._report_stream(request.node_id))
        try:
            async for response in call:
                self._set_interval(response.load_report_interval)
                if response.register_again:
                    raise LinkLost("the controller does not hold every replica this node hosts", registered=True)
        except grpc.aio.AioRpcError as err:
            raise LinkLost.from_rpc("load-report stream ended", err, registered=True) from None
        finally:
            self.registered.clear()
            call.cancel()
        raise LinkLost("load-report stream closed by the controller", registered=True)

    def _set_interval(self, duration: duration_pb2.Duration) -> None:
        seconds = to_seconds(duration)
        if seconds > 0:
            self.interval_s = seconds

    async def _report_stream(self, node_id: str) -> AsyncIterator[registry_pb2.StreamLoadReportsRequest]:
        while True:
            yield registry_pb2.StreamLoadReportsRequest(node_id=node_id, reports=self._reports())
            await asyncio.sleep(self.interval_s)
