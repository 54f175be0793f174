"""gRPC surface of the replica agent: decode -> ReplicaManager call -> encode."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from typing import TYPE_CHECKING

import grpc
from google.protobuf import duration_pb2
from opentelemetry.sdk.trace import TracerProvider

from mesh_runtime import pages
from mesh_runtime.durations import set_seconds, to_seconds
from mesh_runtime.errors import InvalidArgument
from mesh_runtime.multiplex import Multiplexer
from mesh_runtime.reasons import Reason
from mesh_runtime.server import ServiceBinding
from mesh_runtime.status import StatusReporter
from mesh_runtime.validate import check_engine_url, check_id, check_number, check_session_id
from rollmesh.common.v1 import types_pb2, weights_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc, replica_pb2
from rollmesh.weights.v1 import weight_source_pb2 as weights_pb
from rollmesh.weights.v1 import weight_source_pb2_grpc

from . import convert
from .config import ReplicaAgentConfig
from .engines import PauseMode
from .node import Node

if TYPE_CHECKING:
    from mesh_runtime.server import MeshServer

    from .processes import ReplicaProcess
    from .replicas import Replica
    from .weights import ReceiveResult

DESCRIPTOR = pb.DESCRIPTOR.services_by_name["ReplicaAgentService"]
WEIGHTS_DESCRIPTOR = weights_pb.DESCRIPTOR.services_by_name["WeightSourceService"]
PAUSE_MODES: dict[int, PauseMode] = {replica_pb2.PAUSE_MODE_UNSPECIFIED: "wait", replica_pb2.PAUSE_MODE_WAIT: "wait",
               replica_pb2.PAUSE_MODE_ABORT: "abort"}


def _launch_order(replica: Replica | ReplicaProcess) -> str:
    """A key that sorts replicas by launch time, ties by id: ListReplicas' order and its page tokens."""
    return f"{replica.launched_at:020.6f}|{replica.replica_id}"


def _seconds(duration: duration_pb2.Duration, default: float | None) -> float | None:
    return to_seconds(duration) if duration.ByteSize() else default


class ReplicaAgentServicer(replica_agent_pb2_grpc.ReplicaAgentServiceServicer):
    """Implements ``rollmesh.replica.v1.ReplicaAgentService``."""

    admits_own_identity = False
    """Whether callers presenting this server's own certificate are admitted (a replica process, whose agent
    forwards the controller's calls with the agent's certificate)."""

    def __init__(self, config: ReplicaAgentConfig, tracer_provider: TracerProvider | None = None) -> None:
        self.node = Node(config, tracer_provider)
        self.replicas = self.node.replicas
        self.metrics = self.node.server_metrics
        self.status = StatusReporter(config, ["status", "lifecycle", "generate", "generate_many", "sleep", "weights",
                                              "load_reports", "prefix_events"])
        self.also_serves = [ServiceBinding(WEIGHTS_DESCRIPTOR.full_name, ReplicaWeightSource(self.node),
                                           weight_source_pb2_grpc.add_WeightSourceServiceServicer_to_server)]

    async def attach(self, server: MeshServer) -> None:
        await self.node.start(server)

    def _proto(self, replica: Replica | ReplicaProcess) -> replica_pb2.Replica:
        return self.node.replica_proto(replica)

    async def GetStatus(self, request: pb.GetStatusRequest,  # noqa: N802 - gRPC method names
                        context: grpc.aio.ServicerContext) -> pb.GetStatusResponse:
        return pb.GetStatusResponse(
            status=self.status.status(), node_id=self.node.node_id, slots_total=self.node.serving().slots_total,
            slots_free=self.node.serving().slots_free, backend=convert.BACKENDS[self.node.config.backend],
            model=self.node.config.model, replica_count=len(self.node.serving().list()))

    async def LaunchReplica(self, request: pb.LaunchReplicaRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> pb.LaunchReplicaResponse:
        check_id(request.replica_id, "replica_id")
        if request.kind == types_pb2.REPLICA_KIND_UNSPECIFIED:
            raise InvalidArgument("kind must be REPLICA_KIND_STANDALONE or REPLICA_KIND_HYBRID",
                                  reason=Reason.INVALID_KIND)
        if request.HasField("memory_fraction"):
            check_number(request.memory_fraction, "memory_fraction", low=0.0, high=1.0)
        if request.engine_url:
            check_engine_url(request.engine_url, "engine_url")
        replica = await self.node.launch_once(
            request_id=request.request_id, replica_id=request.replica_id, kind=convert.KIND_NAMES[request.kind],
            slots=request.slots or (0 if request.engine_url else 1), engine_url=request.engine_url,
            memory_fraction=request.memory_fraction if request.HasField("memory_fraction") else None,
            start_asleep=request.start_asleep, weight_version=request.weight_version)
        return pb.LaunchReplicaResponse(replica=self._proto(replica))

    async def StopReplica(self, request: pb.StopReplicaRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> pb.StopReplicaResponse:
        grace_s = to_seconds(request.grace) if request.grace.ByteSize() else self.node.config.shutdown_grace_s
        replica = await self.node.serving().stop(request.replica_id, force=request.force, grace_s=grace_s)
        return pb.StopReplicaResponse(replica=self._proto(replica))

    async def ListReplicas(self, request: pb.ListReplicasRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.ListReplicasResponse:
        kinds = [convert.KIND_NAMES[k] for k in request.kinds if k in convert.KIND_NAMES]
        states = [convert.state_name(s) for s in request.states]
        held: list[Replica | ReplicaProcess] = list(self.node.serving().list(kinds, states))
        chosen, token = pages.page(sorted(held, key=_launch_order),
                                   key=_launch_order, page_size=request.page_size, page_token=request.page_token,
                                   filters=(sorted(kinds), sorted(states)))
        return pb.ListReplicasResponse(replicas=[self._proto(r) for r in chosen], next_page_token=token)

    async def GetReplica(self, request: pb.GetReplicaRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> pb.GetReplicaResponse:
        return pb.GetReplicaResponse(replica=self._proto(self.node.serving().get(request.replica_id)))

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        async for message in self.generations(request):
            yield message

    async def GenerateMany(self, request_iterator: AsyncIterator[pb.GenerateManyRequest],  # noqa: N802
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateManyResponse]:
        multiplexer = Multiplexer(lambda request, _: self.generations(request), item=pb.GenerateManyItem,
                                  response=pb.GenerateManyResponse)
        async for response in multiplexer.serve(request_iterator):
            yield response

    async def generations(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """One generation's messages, as a Generate call streams them (GenerateMany runs many of them)."""
        generation = convert.generation_request(request)
        timing = self.node.timing
        assert timing is not None   # an agent that serves generations itself counts them
        replica_id = request.replica_id
        started, outcome, tokens = time.perf_counter(), "failed", 0
        try:
            async for chunk in self.replicas.generate(replica_id, generation):
                if chunk.token_ids:
                    if not tokens:
                        timing.ttft.labels(replica_id).observe(time.perf_counter() - started)
                    tokens += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    outcome = chunk.finish_reason.name.lower()
                yield convert.chunk_to_proto(chunk)
        finally:   # the metrics once per request, not per chunk
            timing.tokens.labels(replica_id).inc(tokens)
            timing.requests.labels(replica_id, outcome).inc()
            timing.duration.labels(replica_id).observe(time.perf_counter() - started)

    async def AbortRequests(self, request: pb.AbortRequestsRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> pb.AbortRequestsResponse:
        if request.WhichOneof("selection") is None or (request.HasField("all") and not request.all):
            raise InvalidArgument("name requests.request_ids or set all", reason=Reason.NOTHING_TO_ABORT)
        ids = None if request.all else list(request.requests.request_ids)
        aborted = await self.replicas.abort(request.replica_id, ids)
        return pb.AbortRequestsResponse(aborted_request_ids=aborted)

    async def CloseSession(self, request: pb.CloseSessionRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.CloseSessionResponse:
        check_session_id(request.session_id, "session_id")
        released = await self.replicas.close_session(request.replica_id, request.session_id)
        return pb.CloseSessionResponse(released=released)

    async def JoinWeightGroup(self, request: pb.JoinWeightGroupRequest,  # noqa: N802
                              context: grpc.aio.ServicerContext) -> pb.JoinWeightGroupResponse:
        backend = weights_pb2.ProcessGroupBackend.Name(request.backend).removeprefix("PROCESS_GROUP_BACKEND_").lower()
        await self.node.trainer_groups().join(
            request.replica_id, host=request.master_address, port=request.master_port, rank=request.rank,
            world_size=request.world_size, group_name=request.group_name, backend=backend,
            timeout_s=_seconds(request.timeout, None))
        return pb.JoinWeightGroupResponse()

    async def ReceiveGroupWeights(self, request: pb.ReceiveGroupWeightsRequest,  # noqa: N802
                                  context: grpc.aio.ServicerContext) -> pb.ReceiveGroupWeightsResponse:
        from .engines.types import WeightSpec  # noqa: PLC0415

        tensors = [WeightSpec(t.name, t.dtype, tuple(t.shape)) for t in request.tensors]
        result = await self.node.trainer_groups().receive(
            request.replica_id, request.group_name, tensors,
            request.weight_version if request.HasField("weight_version") else None, _seconds(request.timeout, None))
        return pb.ReceiveGroupWeightsResponse(result=_weights_results([result])[0])

    async def LeaveWeightGroup(self, request: pb.LeaveWeightGroupRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext) -> pb.LeaveWeightGroupResponse:
        left = await asyncio.to_thread(self.node.trainer_groups().leave, request.replica_id, request.group_name)
        return pb.LeaveWeightGroupResponse(left=left)

    async def FlushCache(self, request: pb.FlushCacheRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> pb.FlushCacheResponse:
        return pb.FlushCacheResponse(replica_ids=await self.replicas.flush_cache(list(request.replica_ids)))

    async def PauseGeneration(self, request: pb.PauseGenerationRequest,  # noqa: N802
                              context: grpc.aio.ServicerContext) -> pb.PauseGenerationResponse:
        if request.mode not in PAUSE_MODES:
            raise InvalidArgument(f"unknown pause mode {request.mode}", reason=Reason.INVALID_PAUSE_MODE)
        aborted = await self.replicas.pause(list(request.replica_ids), mode=PAUSE_MODES[request.mode],
                                            timeout_s=_seconds(request.timeout, None))
        replicas = self.replicas.get_many(request.replica_ids)
        return pb.PauseGenerationResponse(replicas=[self._proto(r) for r in replicas], aborted_request_ids=aborted)

    async def ResumeGeneration(self, request: pb.ResumeGenerationRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext) -> pb.ResumeGenerationResponse:
        replicas = await self.replicas.resume(list(request.replica_ids))
        return pb.ResumeGenerationResponse(replicas=[self._proto(r) for r in replicas])

    async def Sleep(self, request: pb.SleepRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> pb.SleepResponse:
        freed = await self.replicas.sleep(request.replica_id, level=int(request.level),
                                          abort_in_flight=request.abort_in_flight)
        return pb.SleepResponse(freed_bytes=freed, replica=self._proto(self.replicas.get(request.replica_id)))

    async def WakeUp(self, request: pb.WakeUpRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> pb.WakeUpResponse:
        unknown = [t for t in request.tags if t not in convert.WAKE_TAGS]
        if unknown:
            raise InvalidArgument(f"unknown wake tag(s) {unknown}; use WAKE_TAG_WEIGHTS or WAKE_TAG_KV_CACHE",
                                  reason=Reason.INVALID_WAKE_TAG)
        replica = await self.replicas.wake(request.replica_id, tags={convert.WAKE_TAGS[t] for t in request.tags},
                                           resume_generation=request.resume_generation)
        return pb.WakeUpResponse(replica=self._proto(replica))

    async def GetLoadReports(self, request: pb.GetLoadReportsRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.GetLoadReportsResponse:
        replicas = self.replicas.get_many(request.replica_ids)
        return pb.GetLoadReportsResponse(reports=[self.node.load_report(r) for r in replicas])

    async def WatchPrefixCache(self, request: pb.WatchPrefixCacheRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WatchPrefixCacheResponse]:
        hubs = []
        for replica in self.replicas.get_many(request.replica_ids):
            engine = getattr(replica, "engine", None)
            hub = engine.prefix_events() if engine is not None else None
            if hub is not None:
                hubs.append((replica.replica_id, hub))
        queue: asyncio.Queue = asyncio.Queue()
        for replica_id, hub in hubs:
            hub.subscribe(queue, replica_id)
        blocks = {replica_id: hub.block_tokens for replica_id, hub in hubs}
        try:
            while hubs:
                replica_id, reset, stored, removed = await queue.get()
                yield pb.WatchPrefixCacheResponse(replica_id=replica_id, block_tokens=blocks[replica_id],
                                                  reset=reset, stored=stored, removed=removed)
        finally:
            for _, hub in hubs:
                hub.unsubscribe(queue)

    async def ReceiveWeights(self, request: pb.ReceiveWeightsRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.ReceiveWeightsResponse:
        results = await self.node.receive_weights(list(request.replica_ids), request.plan, request.abort_in_flight)
        return pb.ReceiveWeightsResponse(results=_weights_results(results))


    async def LoadCheckpoint(self, request: pb.LoadCheckpointRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.LoadCheckpointResponse:
        step = pb.CheckpointStep.Name(request.step).removeprefix("CHECKPOINT_STEP_")
        results = await self.node.load_checkpoint(
            list(request.replica_ids), step, path=request.checkpoint_path, version=request.weight_version,
            update_id=request.update_id, keep_previous=request.keep_previous)
        return pb.LoadCheckpointResponse(results=_weights_results(results))


def _weights_results(results: list[ReceiveResult]) -> list[pb.ReplicaWeightsResult]:
    out = []
    for r in results:
        item = pb.ReplicaWeightsResult(replica_id=r.replica_id, weight_version=r.weight_version,
                                       checksum_ok=r.checksum_ok, bytes_received=r.bytes_received,
                                       error_message=r.error, delta_base_missing=r.delta_base_missing)
        set_seconds(item.duration, r.duration_s)
        out.append(item)
    return out


class ReplicaWeightSource(weight_source_pb2_grpc.WeightSourceServiceServicer):
    """Implements ``rollmesh.weights.v1.WeightSourceService`` on the replica agent: a seed replica's weights."""

    def __init__(self, node: Node) -> None:
        self.node = node

    async def PrepareWeightSync(self, request: weights_pb.PrepareWeightSyncRequest,  # noqa: N802 - gRPC method names
                                context: grpc.aio.ServicerContext) -> weights_pb.PrepareWeightSyncResponse:
        from weight_transfer.wire import manifest_to_proto  # noqa: PLC0415

        prepared = await self.node.prepare_weight_sync(
            _source_replica(request.source_id), weight_version=request.weight_version,
            bucket_size_bytes=request.bucket_size_bytes if request.HasField("bucket_size_bytes") else None,
            checksum_algorithm=request.checksum_algorithm if request.HasField("checksum_algorithm") else None)
        return weights_pb.PrepareWeightSyncResponse(
            weight_version=prepared.weight_version, manifest=manifest_to_proto(prepared.manifest),
            rendezvous_host=prepared.rendezvous[0], rendezvous_port=prepared.rendezvous[1],
            source=prepared.replica_id)

    async def SendWeights(self, request: weights_pb.SendWeightsRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> weights_pb.SendWeightsResponse:
        sent = await self.node.send_weights(_source_replica(request.source_id), request.plan)
        out = weights_pb.SendWeightsResponse(bytes_sent=sent.bytes_sent, checksum=sent.checksum,
                                             weight_version=sent.weight_version)
        set_seconds(out.duration, sent.duration_s)
        return out


def _source_replica(source_id: str) -> str:
    if not source_id:
        raise InvalidArgument("source_id must name the replica whose weights are sent (a replica agent holds "
                              "one weight source per replica)", reason=Reason.EMPTY_REPLICA_ID)
    return source_id
