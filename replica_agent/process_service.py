"""The replica agent's gRPC surface when each replica runs in a process of its own (``replica_processes``).

The agent keeps what is the node's (status, launch, stop, the list of replicas, registration) and forwards
every call about one replica to that replica's process, which validates and answers it; its errors come
back unchanged. Calls about several replicas go to each one's process at once and their answers are merged.
Generate and GenerateMany also work here (forwarded), though balancers stream from the replica's process at
its ``data_address``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from opentelemetry.sdk.trace import TracerProvider

from rollmesh.weights.v1 import weight_source_pb2
from mesh_runtime.errors import relayed
from rollmesh.replica.v1 import replica_agent_pb2 as pb
from rollmesh.replica.v1 import replica_pb2
from rollmesh.common.v1 import load_pb2
from rollmesh.weights.v1 import weight_source_pb2_grpc

from .config import ReplicaAgentConfig
from .processes import ReplicaProcess, ReplicaProcesses
from .service import ReplicaAgentServicer, _source_replica


async def _call(proc: ReplicaProcess, processes: ReplicaProcesses, method: str, request: Any) -> Any:
    stub = processes.running(proc)
    try:
        return await getattr(stub, method)(request)
    except grpc.aio.AioRpcError as err:
        raise relayed(err) from None


def _keep(proc: ReplicaProcess, replica: replica_pb2.Replica) -> None:
    """Remember the process's latest account of its replica (from a lifecycle call's answer)."""
    if replica.replica_id == proc.replica_id:
        proc.replica = replica


class ProcessReplicaAgentServicer(ReplicaAgentServicer):
    """``rollmesh.replica.v1.ReplicaAgentService`` of an agent that runs its replicas in processes."""

    def __init__(self, config: ReplicaAgentConfig, tracer_provider: TracerProvider | None = None) -> None:
        super().__init__(config, tracer_provider)
        assert self.node.processes is not None
        self.processes: ReplicaProcesses = self.node.processes
        self.also_serves = [dataclasses.replace(self.also_serves[0], servicer=ProcessWeightSource(self.processes))]

    async def _each(self, replica_ids: Sequence[str],
                    call: Callable[[ReplicaProcess, list[str]], Awaitable[Any]]) -> list[Any]:
        """``call(process, [its replica id])`` for each named replica (all when none are named), at once."""
        procs = self.processes.get_many(replica_ids)
        if not replica_ids:
            procs = [p for p in procs if p.stub is not None and not p.ended and p.state != "STOPPED"]
        return list(await asyncio.gather(*(call(p, [p.replica_id]) for p in procs)))

    async def generations(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        proc = self.processes.get(request.replica_id)
        stream = self.processes.running(proc).Generate(request)
        try:
            async for message in stream:
                yield message
        except grpc.aio.AioRpcError as err:
            raise relayed(err) from None
        finally:
            stream.cancel()

    async def AbortRequests(self, request: pb.AbortRequestsRequest,  # noqa: N802 - gRPC method names
                            context: grpc.aio.ServicerContext) -> pb.AbortRequestsResponse:
        return await _call(self.processes.get(request.replica_id), self.processes, "AbortRequests", request)

    async def CloseSession(self, request: pb.CloseSessionRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.CloseSessionResponse:
        return await _call(self.processes.get(request.replica_id), self.processes, "CloseSession", request)

    async def Sleep(self, request: pb.SleepRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> pb.SleepResponse:
        proc = self.processes.get(request.replica_id)
        reply = await _call(proc, self.processes, "Sleep", request)
        _keep(proc, reply.replica)
        return pb.SleepResponse(freed_bytes=reply.freed_bytes, replica=self._proto(proc))

    async def WakeUp(self, request: pb.WakeUpRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> pb.WakeUpResponse:
        proc = self.processes.get(request.replica_id)
        reply = await _call(proc, self.processes, "WakeUp", request)
        _keep(proc, reply.replica)
        return pb.WakeUpResponse(replica=self._proto(proc))

    async def PauseGeneration(self, request: pb.PauseGenerationRequest,  # noqa: N802
                              context: grpc.aio.ServicerContext) -> pb.PauseGenerationResponse:
        async def one(proc: ReplicaProcess, ids: list[str]) -> tuple[ReplicaProcess, pb.PauseGenerationResponse]:
            part = pb.PauseGenerationRequest()
            part.CopyFrom(request)
            part.replica_ids[:] = ids
            reply = await _call(proc, self.processes, "PauseGeneration", part)
            for replica in reply.replicas:
                _keep(proc, replica)
            return proc, reply

        answers = await self._each(list(request.replica_ids), one)
        return pb.PauseGenerationResponse(replicas=[self._proto(p) for p, _ in answers],
                                          aborted_request_ids=[i for _, r in answers for i in r.aborted_request_ids])

    async def ResumeGeneration(self, request: pb.ResumeGenerationRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext) -> pb.ResumeGenerationResponse:
        async def one(proc: ReplicaProcess, ids: list[str]) -> ReplicaProcess:
            reply = await _call(proc, self.processes, "ResumeGeneration", pb.ResumeGenerationRequest(replica_ids=ids))
            for replica in reply.replicas:
                _keep(proc, replica)
            return proc

        procs = await self._each(list(request.replica_ids), one)
        return pb.ResumeGenerationResponse(replicas=[self._proto(p) for p in procs])

    async def GetLoadReports(self, request: pb.GetLoadReportsRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.GetLoadReportsResponse:
        async def one(proc: ReplicaProcess, ids: list[str]) -> load_pb2.LoadReport:
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await self.processes.running(proc).GetLoadReports(pb.GetLoadReportsRequest(replica_ids=ids), timeout=5.0)
                if reply.reports:
                    proc.report = reply.reports[0]
            return self.node.load_report(proc)

        procs = self.processes.get_many(request.replica_ids)
        live = [p for p in procs if p.stub is not None and not p.ended and p.state != "STOPPED"]
        fresh = {r.replica_id: r for r in await asyncio.gather(*(one(p, [p.replica_id]) for p in live))}
        return pb.GetLoadReportsResponse(reports=[fresh.get(p.replica_id) or self.node.load_report(p)
                                                  for p in procs])

    async def WatchPrefixCache(self, request: pb.WatchPrefixCacheRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WatchPrefixCacheResponse]:
        procs = [p for p in self.processes.get_many(request.replica_ids)
                 if p.stub is not None and not p.ended and p.state != "STOPPED"]
        queue: asyncio.Queue = asyncio.Queue()

        async def follow(proc: ReplicaProcess) -> None:
            stream = self.processes.running(proc).WatchPrefixCache(pb.WatchPrefixCacheRequest(replica_ids=[proc.replica_id]))
            try:
                async for message in stream:
                    await queue.put(message)
            except grpc.aio.AioRpcError as err:
                await queue.put(relayed(err))
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(follow(p)) for p in procs]
        try:
            open_streams = len(tasks)
            while open_streams:
                item = await queue.get()
                if item is None:
                    open_streams -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def ReceiveWeights(self, request: pb.ReceiveWeightsRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.ReceiveWeightsResponse:
        async def one(proc: ReplicaProcess, ids: list[str]) -> pb.ReceiveWeightsResponse:
            part = pb.ReceiveWeightsRequest()
            part.CopyFrom(request)
            part.replica_ids[:] = ids
            return await _call(proc, self.processes, "ReceiveWeights", part)

        if not request.replica_ids:   # the in-process agent's message for an empty list
            return await super().ReceiveWeights(request, context)
        out = pb.ReceiveWeightsResponse()
        for reply in await self._each(list(request.replica_ids), one):
            out.results.extend(reply.results)
        return out


class ProcessWeightSource(weight_source_pb2_grpc.WeightSourceServiceServicer):
    """``rollmesh.weights.v1.WeightSourceService``: a seed replica's weights, from its process."""

    def __init__(self, processes: ReplicaProcesses) -> None:
        self.processes = processes

    async def _forward(self, method: str, request: Any) -> Any:
        proc = self.processes.get(_source_replica(request.source_id))
        self.processes.running(proc)   # FAILED_PRECONDITION unless its process serves
        try:
            return await getattr(proc.weights, method)(request)
        except grpc.aio.AioRpcError as err:
            raise relayed(err) from None

    async def PrepareWeightSync(self, request: weight_source_pb2.PrepareWeightSyncRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> weight_source_pb2.PrepareWeightSyncResponse:
        return await self._forward("PrepareWeightSync", request)

    async def SendWeights(self, request: weight_source_pb2.SendWeightsRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> weight_source_pb2.SendWeightsResponse:
        return await self._forward("SendWeights", request)
