"""The typed client behind :mod:`trainer_client`."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc

from mesh_runtime import samples
from mesh_runtime.channels import open_balancer_channel, open_channel, read_methods
from mesh_runtime.discovery import open_discovered_balancers
from mesh_runtime.durations import duration, set_seconds
from mesh_runtime.generate_many import BalancerGenerations
from mesh_runtime.retry import call_again, retry_same
from mesh_runtime.tls import TlsConfig
from rollmesh.controller.v1 import events_pb2
from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc, observability_pb2, scaling_pb2
from rollmesh.controller.v1 import registry_pb2, scheduling_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2

T = TypeVar("T")


def operation_metadata(operation: operations_pb2.Operation) -> scaling_pb2.ScaleOperation:
    """The progress a scale operation's ``google.longrunning.Operation`` carries as its metadata."""
    metadata = scaling_pb2.ScaleOperation()
    operation.metadata.Unpack(metadata)
    return metadata


class StepProtocolError(RuntimeError):
    """A step-protocol call the controller refused for good, or that found no controller before its deadline."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Counters:
    """What the trainer tells the controller, in samples (one prompt with its ``rollout.n`` responses).

    Set the first three once from the trainer's config; update the others as the trainer runs. The client
    derives the rest of the step report (``expected_samples``, ``buffer_samples``) with verl's formulas.
    """

    required_samples: int
    """Samples one training step consumes: verl's ``ppo_mini_batch_size x require_batches``."""
    trigger_parameter_sync_step: int = 1
    """Training steps between weight syncs."""
    staleness_threshold: float = 0.0
    """verl's ``async_training.staleness_threshold`` (headroom the rollout may run ahead)."""
    generated_samples: int = 0
    """Samples generated so far in the whole run (cumulative; the policies compare it with
    ``required_samples x trigger x global_step``)."""
    queued_samples: int = 0
    """Samples waiting in the trainer's buffer now."""
    consumed_samples: int = 0
    """Samples the last step consumed (informational)."""
    dropped_samples: int = 0
    """Samples the last step dropped as too stale (informational)."""
    step_wait_times_s: list[float] = dataclasses.field(default_factory=list)
    """How long each collection of the last step waited for its samples."""
    step_wait_samples: list[int] = dataclasses.field(default_factory=list)
    """How many samples each of those collections had to wait for."""
    timing_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """verl's ``timing_raw`` of the last step in seconds (``gen``, ``update_actor``, ...)."""

    def report(self, global_step: int) -> scheduling_pb2.StepReport:
        step_required = samples.step_required_samples(self.required_samples, self.trigger_parameter_sync_step)
        report = scheduling_pb2.StepReport(
            required_samples=self.required_samples, trigger_parameter_sync_step=self.trigger_parameter_sync_step,
            total_generated_samples=self.generated_samples,
            expected_samples=samples.expected_samples(step_required, global_step),
            buffer_samples=samples.buffer_samples(step_required, self.staleness_threshold),
            queue_size=self.queued_samples, samples_consumed=self.consumed_samples,
            samples_dropped=self.dropped_samples, step_wait_samples=list(self.step_wait_samples))
        for seconds in self.step_wait_times_s:
            report.step_wait_times.append(duration(seconds))
        for key, seconds in self.timing_s.items():
            report.timing_raw[key].CopyFrom(duration(seconds))
        return report


@dataclasses.dataclass(frozen=True)
class BeginResult:
    deactivate: bool
    """Whether hybrid replicas are to be released before this step: wait until the buffer holds
    ``wait_samples`` (at most ``wait_timeout_s``), then call :meth:`MeshClient.release_hybrids`."""
    wait_samples: int
    wait_timeout_s: float
    response: scheduling_pb2.BeginTrainingStepResponse


@dataclasses.dataclass(frozen=True)
class ReleaseResult:
    released_replica_ids: list[str]
    failed_replica_ids: list[str]
    response: scheduling_pb2.ReleaseHybridReplicasResponse


@dataclasses.dataclass(frozen=True)
class CompleteResult:
    hybrid_activated: bool
    bytes_sent: int
    bytes_saved: int
    failed_replicas: dict[str, str]
    """Replicas whose part of the broadcast failed, with the error (they are synced again or leave routing)."""
    response: scheduling_pb2.CompleteTrainingStepResponse


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
        """``call(timeout)`` again with the same request while the controller cannot answer, until the retry
        deadline (:func:`mesh_runtime.retry.call_again`, the loop the built-in driver uses too): the step
        protocol's calls are idempotent, a repeated call gets the recorded answer."""
        try:
            return await call_again(call, within_s=self._retry_deadline, timeout_s=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise StepProtocolError(f"{what} failed: {err.code().name}: {err.details()}", err.code()) from err

    # -- the step protocol ------------------------------------------------------------------------

    async def begin_step(self, global_step: int, counters: Counters) -> BeginResult:
        request = scheduling_pb2.BeginTrainingStepRequest(global_step=global_step, report=counters.report(global_step))
        reply = await self._retried(f"BeginTrainingStep({global_step})", lambda timeout: self._stub.BeginTrainingStep(
            request, timeout=timeout, metadata=self._metadata), self._call_timeout)
        return BeginResult(reply.deactivate, reply.wait_samples, reply.wait_timeout.ToTimedelta().total_seconds(),
                           reply)

    async def release_hybrids(self, global_step: int, *, buffered_samples: int, waited_s: float,
                              wait_expired: bool) -> ReleaseResult:
        request = scheduling_pb2.ReleaseHybridReplicasRequest(
            global_step=global_step, buffered_samples=buffered_samples, waited=duration(waited_s),
            wait_expired=wait_expired)
        reply = await self._retried(f"ReleaseHybridReplicas({global_step})", lambda timeout: (
            self._stub.ReleaseHybridReplicas(request, timeout=timeout, metadata=self._metadata)), self._call_timeout)
        return ReleaseResult(list(reply.released_replica_ids), list(reply.failed_replica_ids), reply)

    async def complete_step(self, global_step: int, weight_version: int, counters: Counters) -> CompleteResult:
        """End the step: the controller broadcasts ``weight_version`` from the trainer agent (whose weight
        source must hold it) and may activate the hybrid replicas."""
        request = scheduling_pb2.CompleteTrainingStepRequest(global_step=global_step, weight_version=weight_version,
                                                             report=counters.report(global_step))
        reply = await self._retried(f"CompleteTrainingStep({global_step})", lambda timeout: (
            self._stub.CompleteTrainingStep(request, timeout=timeout, metadata=self._metadata)), self._sync_timeout)
        failed = {r.replica_id: r.error_message for sync in (reply.standalone_sync, reply.hybrid_sync)
                  for r in sync.replica_results if not r.ok}
        return CompleteResult(reply.hybrid_activated, reply.bytes_sent, reply.bytes_saved, failed, reply)

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
        return await open_discovered_balancers(self.address, tls=self._tls, idempotent=read_methods(),
                                               timeout_s=timeout_s)

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
                     types: Sequence[int] = ()) -> AsyncIterator[events_pb2.LifecycleEvent]:
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
