"""The typed client behind :mod:`trainer_client`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc

from mesh_runtime.channels import as_channel, open_channel, read_methods
from mesh_runtime.hash_ring import open_balancer_channel
from mesh_runtime.discovery import open_discovered_balancers
from mesh_runtime.durations import set_seconds
from mesh_runtime.generate_many import BalancerGenerations
from mesh_runtime.retry import call_again, retry_same
from mesh_runtime.tls import TlsConfig
from rollmesh.controller.v1 import events_pb2
from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc, observability_pb2, scaling_pb2
from rollmesh.controller.v1 import registry_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2

from .steps import BeginResult, CompleteResult, Counters, ReleaseResult, StepProtocol, StepProtocolError

T = TypeVar("T")


def operation_metadata(operation: operations_pb2.Operation) -> scaling_pb2.ScaleOperation:
    """The progress a scale operation's ``google.longrunning.Operation`` carries as its metadata."""
    metadata = scaling_pb2.ScaleOperation()
    operation.metadata.Unpack(metadata)
    return metadata


class MeshClient:
    """One controller, from a custom trainer. Use ``async with MeshClient(address) as mesh``; ``address`` may
    list several controllers of one etcd store (``"HOST:PORT,HOST:PORT"``): calls follow the leader."""

    def __init__(self, controller_address: str, *, tls: TlsConfig | None = None, call_timeout_s: float = 60.0,
                 retry_deadline_s: float = 120.0, sync_timeout_s: float = 600.0,
                 metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.address = controller_address
        self._tls = tls
        self._channel = open_channel(controller_address, tls=tls, idempotent=read_methods())
        self._stub = controller_pb2_grpc.ControllerServiceStub(self._channel)
        self._operations = operations_pb2_grpc.OperationsStub(self._channel)
        self._call_timeout = call_timeout_s
        self._retry_deadline = retry_deadline_s
        self._sync_timeout = sync_timeout_s
        self._metadata = tuple(metadata)
        self._generations: dict[int, tuple[grpc.aio.Channel, BalancerGenerations]] = {}
        self.steps = StepProtocol(self._stub, window_s=retry_deadline_s, sync_window_s=retry_deadline_s,
                                  try_timeout_s=call_timeout_s, sync_try_timeout_s=sync_timeout_s,
                                  metadata=self._metadata)
        """The step protocol's calls, each repeated while the controller cannot answer it until the retry
        deadline (the controller answers a repeated call with its recorded answer)."""

    async def __aenter__(self) -> MeshClient:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the controller channel and the generation streams (not the channels given to
        :meth:`generate`)."""
        for _, generations in self._generations.values():
            await generations.close()
        self._generations.clear()
        await self._channel.close()

    async def _retried(self, what: str, call: Callable[[float], Awaitable[T]], timeout_s: float) -> T:
        """``call(timeout)`` again while the controller cannot answer, until the retry deadline
        (:func:`mesh_runtime.retry.call_again`, the step protocol's loop too)."""
        try:
            return await call_again(call, within_s=self._retry_deadline, timeout_s=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise StepProtocolError(f"{what} failed: {err.code().name}: {err.details()}", err.code()) from err

    # -- the step protocol (:class:`trainer_client.steps.StepProtocol`) ----------------------------------

    async def begin_step(self, global_step: int, counters: Counters) -> BeginResult:
        """Start training step ``global_step``: whether to release the hybrid replicas first, and after how
        many buffered samples."""
        return await self.steps.begin_step(global_step, counters)

    async def release_hybrids(self, global_step: int, *, buffered_samples: int, waited_s: float,
                              wait_expired: bool) -> ReleaseResult:
        """Release the hybrid replicas (only after a begin that said ``deactivate``)."""
        return await self.steps.release_hybrids(global_step, buffered_samples=buffered_samples, waited_s=waited_s,
                                                wait_expired=wait_expired)

    async def complete_step(self, global_step: int, weight_version: int, counters: Counters) -> CompleteResult:
        """End the step: the controller broadcasts ``weight_version`` from the trainer agent (whose weight
        source must hold it) and may activate the hybrid replicas."""
        return await self.steps.complete_step(global_step, weight_version, counters)

    # -- balancers ----------------------------------------------------------------------------------

    async def balancers(self, *, ready_only: bool = False) -> list[registry_pb2.BalancerRecord]:
        """The load balancers the controller keeps in line (configured and registered), by id."""
        reply = await self._retried("ListBalancers", lambda timeout: self._stub.ListBalancers(
            registry_pb2.ListBalancersRequest(ready_only=ready_only), timeout=timeout, metadata=self._metadata),
            self._call_timeout)
        return list(reply.balancers)

    async def generation_channel(self, balancer_address: str = "", *, timeout_s: float = 60.0) -> grpc.aio.Channel:
        """A channel for ``LoadBalancerServiceStub`` whose ``Generate`` calls spread over the balancers by a
        consistent hash of ``request_id`` (a repeated id lands on the same balancer, and on the next one in
        the ring when that one is down). ``balancer_address``: ``HOST:PORT[,HOST:PORT...]``; empty = the
        balancers registered with this controller, re-read in the background. Close it when done."""
        if balancer_address:
            return open_balancer_channel(balancer_address, tls=self._tls, idempotent=read_methods())
        return as_channel(await open_discovered_balancers(self.address, tls=self._tls, idempotent=read_methods(),
                                               timeout_s=timeout_s))

    async def generate(self, channel: grpc.aio.Channel, request: loadbalancer_pb2.GenerateRequest, *,
                       timeout_s: float | None = None) -> loadbalancer_pb2.GenerateResponse:
        """One completion through ``channel`` (from :meth:`generation_channel`, or any channel to a balancer):
        its final message only (``final_only``: no token chunks cross the wire, ``token_ids`` holds every
        generated token). Requests travel on the balancers' ``GenerateMany`` streams (one per balancer,
        :class:`~mesh_runtime.generate_many.BalancerGenerations`), so many concurrent calls cost no call each.
        The balancer retries and resumes as usual; gRPC errors propagate as :class:`grpc.aio.AioRpcError`."""
        sent = loadbalancer_pb2.GenerateRequest()
        sent.CopyFrom(request)   # the caller's message stays as it was
        sent.final_only = True
        entry = self._generations.get(id(channel))
        if entry is None or entry[0] is not channel:
            entry = self._generations[id(channel)] = (channel, BalancerGenerations(channel, metadata=self._metadata))
        final = None
        async for message in entry[1].call(sent, timeout_s=timeout_s):
            final = message
        if final is None:
            raise StepProtocolError(f"Generate({request.request_id[:64]!r}) ended without a result")
        return final

    # -- events ------------------------------------------------------------------------------------

    async def events(self, *, from_sequence: int = 0, include_history: bool = False,
                     types: Sequence[events_pb2.EventType.ValueType] = ()) -> AsyncIterator[events_pb2.LifecycleEvent]:
        """Lifecycle events, forever; after a broken stream (a controller restart) it reconnects and resumes
        from the sequence after the last event it yielded, so none is seen twice."""
        next_sequence = from_sequence
        while True:
            request = observability_pb2.WatchEventsRequest(from_sequence=next_sequence, types=list(types),
                                                           include_history=include_history and next_sequence == 0)
            try:
                async for message in self._stub.WatchEvents(request, metadata=self._metadata):
                    event = message.event
                    if event.sequence < next_sequence:
                        continue
                    next_sequence = event.sequence + 1
                    yield event
            except grpc.aio.AioRpcError as err:
                if not retry_same(err, idempotent=True):   # it resumes after the last event it yielded
                    raise StepProtocolError(f"WatchEvents failed: {err.code().name}: {err.details()}",
                                            err.code()) from err
            await asyncio.sleep(0.2)

    # -- scale operations ---------------------------------------------------------------------------

    async def scale_out(self, *, num_replicas: int = 0, engine_addresses: Sequence[str] = (), model_name: str = "",
                        request_id: str = "", wait: bool = True, timeout_s: float = 600.0
                        ) -> scaling_pb2.ScaleOperation:
        """Start a scale-out (``num_replicas`` > 0: native, else ``engine_addresses``: external) and return its
        progress, once it has ended when ``wait``."""
        request = scaling_pb2.ScaleOutRequest(model_name=model_name, request_id=request_id)
        if num_replicas:
            request.num_replicas = num_replicas
        if engine_addresses:
            request.external.addresses.extend(engine_addresses)
        reply = await self._retried("ScaleOut", lambda timeout: self._stub.ScaleOut(
            request, timeout=timeout, metadata=self._metadata), self._call_timeout)
        return await self._progress(reply, wait, timeout_s)

    async def scale_in(self, *, num_replicas: int = 0, replica_ids: Sequence[str] = (),
                       engine_addresses: Sequence[str] = (), model_name: str = "", request_id: str = "",
                       wait: bool = True, timeout_s: float = 600.0) -> scaling_pb2.ScaleOperation:
        """Start a scale-in (``num_replicas`` > 0: the target count, else the replicas named) and return its
        progress, once it has ended when ``wait``."""
        request = scaling_pb2.ScaleInRequest(model_name=model_name, request_id=request_id)
        if num_replicas:
            request.num_replicas = num_replicas
        if replica_ids or engine_addresses:
            request.replicas.replica_ids.extend(replica_ids)
            request.replicas.engine_addresses.extend(engine_addresses)
        reply = await self._retried("ScaleIn", lambda timeout: self._stub.ScaleIn(
            request, timeout=timeout, metadata=self._metadata), self._call_timeout)
        return await self._progress(reply, wait, timeout_s)

    async def _progress(self, reply: operations_pb2.Operation, wait: bool, timeout_s: float
                        ) -> scaling_pb2.ScaleOperation:
        if wait and not reply.done:
            return await self.wait_operation(reply.name.removeprefix("operations/"), timeout_s)
        return operation_metadata(reply)

    async def wait_operation(self, operation_id: str, timeout_s: float = 600.0) -> scaling_pb2.ScaleOperation:
        """Wait (google.longrunning.Operations.WaitOperation) until ``operation_id`` ends: ACTIVE, COMPLETED,
        FAILED, CANCELLED or NOOP."""
        deadline = time.monotonic() + timeout_s
        while True:
            wait_s = max(0.1, min(deadline - time.monotonic(), 30.0))   # one wait: at most 30 s
            request = operations_pb2.WaitOperationRequest(name=f"operations/{operation_id}")
            set_seconds(request.timeout, wait_s)
            reply = await self._retried("WaitOperation", lambda timeout: self._operations.WaitOperation(
                request, timeout=timeout, metadata=self._metadata), wait_s + self._call_timeout)
            if reply.done:
                return operation_metadata(reply)
            if time.monotonic() > deadline:
                raise StepProtocolError(f"operation {operation_id} did not end within {timeout_s:g} s "
                                        f"({scaling_pb2.OperationState.Name(operation_metadata(reply).state)})")

    async def status(self) -> controller_pb2.GetStatusResponse:
        return await self._retried("GetStatus", lambda timeout: self._stub.GetStatus(
            controller_pb2.GetStatusRequest(), timeout=timeout, metadata=self._metadata), self._call_timeout)
