"""gRPC surface of the controller: decode -> a :class:`~controller.api.ControllerApi` call -> encode."""

from __future__ import annotations

from collections.abc import AsyncIterator
import logging

import grpc
from google.longrunning import operations_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from mesh_runtime import pages
from mesh_runtime.durations import to_seconds
from mesh_runtime.errors import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted
from mesh_runtime.identity import current_identity
from mesh_runtime.metrics import LoopStallMonitor, ServerMetrics
from mesh_runtime.reasons import Reason
from mesh_runtime.server import MeshServer, ServiceBinding
from mesh_runtime.status import StatusReporter
from mesh_runtime.validate import check_address, check_reachable
from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc, events_pb2, observability_pb2, registry_pb2
from rollmesh.common.v1 import weights_pb2
from rollmesh.controller.v1 import scheduling_pb2, weight_sync_pb2

from . import convert
from .auth import has_scale_token, require_own_node, require_scale_credential
from .config import ControllerConfig
from .core.events import EventType, LifecycleEvent
from .leadership import Leadership, StandbyGate
from .api import ControllerApi
from .ports import Channels
from .peers import Peers
from .prometheus import ControllerMetrics, Observed
from .scaling import lro
from .scaling.service import ScalingRpcs

log = logging.getLogger(__name__)
DESCRIPTOR = controller_pb2.DESCRIPTOR.services_by_name["ControllerService"]


class ControllerServicer(ScalingRpcs, controller_pb2_grpc.ControllerServiceServicer):
    """Implements ``rollmesh.controller.v1.ControllerService``."""

    def __init__(self, config: ControllerConfig, tracer_provider: TracerProvider | None) -> None:
        self.config = config
        self.status = StatusReporter(config, ["status", "registry", "scheduling", "weight_sync", "events",
                                              "metrics", "scaling", "autoscaler"])
        self.leadership = Leadership(config, tracer_provider, on_mesh=self._serve_from)
        self.interceptors = [StandbyGate(self.leadership)]
        self.metrics = ServerMetrics()
        self.prometheus = ControllerMetrics(self.leadership.mesh, self.metrics)
        self._peer_channels = Channels(tracer_provider, tls=config.tls)
        self.peers = Peers(balancers=lambda: self.api.balancer_addresses(),
                           timeout_s=config.peer_timeout_s, channels=self._peer_channels)
        self.also_serves = [ServiceBinding(lro.SERVICE_NAME, lro.OperationsServicer(lambda: self.api.scaler, config),
                                           operations_pb2_grpc.add_OperationsServicer_to_server)]

    @property
    def api(self) -> ControllerApi:
        """The mesh served from (the leader's, or a standby's read-only copy, replaced at each refresh), as the
        port the RPCs use."""
        return self.leadership.mesh

    def _serve_from(self, mesh: Observed) -> None:
        self.prometheus.bind(mesh)

    async def attach(self, server: MeshServer) -> None:
        server.add_cleanup(self._peer_channels.close)
        server.add_cleanup(self.leadership.close)
        server.spawn(LoopStallMonitor(self.metrics).run(), name="loop-stall-monitor")
        await self.leadership.start(server)

    # ---------------------------------------------------------------- status
    async def GetStatus(self, request: controller_pb2.GetStatusRequest,  # noqa: N802 - gRPC method names throughout
                        context: grpc.aio.ServicerContext) -> controller_pb2.GetStatusResponse:
        api = self.api
        present, active = api.registry.present_and_active()
        return controller_pb2.GetStatusResponse(
            status=self.status.status(), peers=await self.peers.probe(),
            hybrid_state=scheduling_pb2.HybridState.Value(api.scheduler.hybrid_state.proto_name),
            node_count=api.registry.node_count(), replica_count=present, active_replica_count=active,
            last_event_sequence=api.last_event_sequence,
            running_operation_id=getattr(api.scaler.book.running(), "operation_id", ""),
            state_store=api.state_store, **self.leadership.status_fields())

    # -------------------------------------------------------------- registry
    def token_check(self, context: grpc.aio.ServicerContext) -> bool:
        """The operator bearer-token alternative of the authorization table (ScaleOut, ScaleIn, ...)."""
        return has_scale_token(context, self.config)

    async def RegisterNode(self, request: registry_pb2.RegisterNodeRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> registry_pb2.RegisterNodeResponse:
        require_own_node(request.node_id, "RegisterNode")
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:   # its caller gave up: doing it now would help nobody
            raise DeadlineExceeded(f"registration of node {request.node_id[:64]!r} reached the controller after "
                                   "its deadline; nothing was registered", reason=Reason.DEADLINE_PASSED)
        wait = self.api.admit()
        if wait:
            raise ResourceExhausted(
                f"more than max_registrations_per_s={self.config.max_registrations_per_s:g} registrations this "
                f"second; node {request.node_id[:64]!r} was not registered: retry in {wait:.2f} s",
                reason=Reason.REGISTRATIONS_THROTTLED, retry_delay_s=wait)
        check_reachable(request.address, context.peer(), f"node {request.node_id[:64]!r}")
        self.api.pace()   # the lease it gets is the one of the fleet's current pace
        registration = await self.api.register_node(request)
        reply = registry_pb2.RegisterNodeResponse(node_id=registration.node_id,
                                                  accepted_replica_ids=registration.accepted,
                                                  rejected_replica_ids=list(registration.rejected))
        interval, ttl = self.api.pace()
        reply.lease_ttl.CopyFrom(convert.duration(ttl))
        reply.load_report_interval.CopyFrom(convert.duration(interval))
        return reply

    async def DeregisterNode(self, request: registry_pb2.DeregisterNodeRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> registry_pb2.DeregisterNodeResponse:
        require_own_node(request.node_id, "DeregisterNode")
        stopped = await self.api.deregister_node(request.node_id, request.reason)
        return registry_pb2.DeregisterNodeResponse(stopped_replica_ids=stopped)

    async def StreamLoadReports(  # noqa: N802
            self, request_iterator: AsyncIterator[registry_pb2.StreamLoadReportsRequest],
            context: grpc.aio.ServicerContext) -> AsyncIterator[registry_pb2.StreamLoadReportsResponse]:
        node_id, told = "", None
        async for message in request_iterator:
            if not message.node_id or (node_id and message.node_id != node_id):
                raise InvalidArgument("every message of a load-report stream must carry the same, non-empty "
                                      "node_id", reason=Reason.INVALID_NODE_ID)
            if not node_id:
                require_own_node(message.node_id, "StreamLoadReports")
            pace = self.api.pace()
            expires, register_again = self.api.renew(message.node_id, message.reports)
            # answer the first report, a needed re-registration, and every change of pace (the fleet grew)
            if not node_id or register_again or pace != told:
                node_id, told = message.node_id, pace
                reply = registry_pb2.StreamLoadReportsResponse(register_again=register_again)
                reply.load_report_interval.CopyFrom(convert.duration(pace[0]))
                reply.lease_ttl.CopyFrom(convert.duration(pace[1]))
                reply.lease_expires_at.CopyFrom(convert.timestamp(expires))
                yield reply

    async def RegisterBalancer(self, request: registry_pb2.RegisterBalancerRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext) -> registry_pb2.RegisterBalancerResponse:
        check_reachable(request.address, context.peer(), f"balancer {request.balancer_id[:64]!r}")
        return await self.api.balancers.register(request)

    async def DeregisterBalancer(self, request: registry_pb2.DeregisterBalancerRequest,  # noqa: N802
                                 context: grpc.aio.ServicerContext) -> registry_pb2.DeregisterBalancerResponse:
        return await self.api.balancers.deregister(request)

    async def ListBalancers(self, request: registry_pb2.ListBalancersRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> registry_pb2.ListBalancersResponse:
        return registry_pb2.ListBalancersResponse(balancers=self.api.balancers.records(ready_only=request.ready_only))

    async def ListNodes(self, request: registry_pb2.ListNodesRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> registry_pb2.ListNodesResponse:
        registry = self.api.registry
        nodes, token = pages.page(registry.nodes(), key=lambda n: n.node_id, page_size=request.page_size,
                                  page_token=request.page_token, filters=())
        records = await pages.convert_all(nodes, lambda n: convert.node_record(
            n, [r.replica_id for r in registry.replicas(node_id=n.node_id)]))
        return registry_pb2.ListNodesResponse(nodes=records, next_page_token=token)

    async def GetNode(self, request: registry_pb2.GetNodeRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> registry_pb2.GetNodeResponse:
        registry = self.api.registry
        node = registry.node(request.node_id)
        replicas = registry.replicas(node_id=node.node_id)
        return registry_pb2.GetNodeResponse(node=convert.node_record(node, [r.replica_id for r in replicas]),
                                            replicas=[convert.replica_record(r) for r in replicas])

    async def ListReplicas(self, request: registry_pb2.ListReplicasRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> registry_pb2.ListReplicasResponse:
        kinds = {convert.kind_from_proto(k) for k in request.kinds}
        states = {convert.state_from_proto(s) for s in request.states}
        records = [r for r in self.api.registry.replicas(node_id=request.node_id or None)
                   if (not kinds or r.kind in kinds) and (not states or r.state in states)
                   and (not request.model_name or r.model_name == request.model_name)]
        filters = (sorted(request.kinds), sorted(request.states), request.node_id, request.model_name)
        chosen, token = pages.page(records, key=lambda r: r.replica_id, page_size=request.page_size,
                                   page_token=request.page_token, filters=filters)
        replicas = await pages.convert_all(chosen, convert.replica_record)
        return registry_pb2.ListReplicasResponse(replicas=replicas, next_page_token=token)

    async def GetReplica(self, request: registry_pb2.GetReplicaRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> registry_pb2.GetReplicaResponse:
        return registry_pb2.GetReplicaResponse(replica=convert.replica_record(self.api.registry.get(request.replica_id)))

    # ------------------------------------------------------------ scheduling
    async def BeginTrainingStep(self, request: scheduling_pb2.BeginTrainingStepRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> scheduling_pb2.BeginTrainingStepResponse:
        decision = await self.api.begin_step(request.global_step, convert.step_report(request.report))
        return convert.begin_response(decision)

    async def ReleaseHybridReplicas(self, request: scheduling_pb2.ReleaseHybridReplicasRequest,  # noqa: N802
                                    context: grpc.aio.ServicerContext) -> scheduling_pb2.ReleaseHybridReplicasResponse:
        result = await self.api.release_hybrid(request.global_step, request.buffered_samples,
                                                convert.seconds(request.waited), request.wait_expired)
        return convert.release_response(result)

    async def CompleteTrainingStep(self, request: scheduling_pb2.CompleteTrainingStepRequest,  # noqa: N802
                                   context: grpc.aio.ServicerContext) -> scheduling_pb2.CompleteTrainingStepResponse:
        result = await self.api.complete_step(request.global_step, request.weight_version,
                                               convert.step_report(request.report))
        return convert.complete_response(result)

    async def GetSchedulerState(self, request: scheduling_pb2.GetSchedulerStateRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> scheduling_pb2.GetSchedulerStateResponse:
        return convert.scheduler_state(self.api.scheduler.scheduler_state())

    async def SyncWeights(self, request: weight_sync_pb2.SyncWeightsRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> weight_sync_pb2.SyncWeightsResponse:
        timeout_s = _weights_call(request)
        if request.source_address:
            check_address(request.source_address, "source_address")
        outcome = await self.api.weight_requests.sync_weights(
            list(request.replica_ids), request.weight_version if request.HasField("weight_version") else None,
            timeout_s=timeout_s, source_address=request.source_address)
        return weight_sync_pb2.SyncWeightsResponse(result=convert.sync_result(outcome))

    def _require_weights_caller(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """A trainer agent's certificate, or what an operator's mutation needs (the scale credential)."""
        identity = current_identity()
        if identity is None or identity.role != "trainer-agent":
            require_scale_credential(context, self.config, method)

    async def LoadWeights(self, request: weight_sync_pb2.LoadWeightsRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> weight_sync_pb2.LoadWeightsResponse:
        self._require_weights_caller(context, "LoadWeights")
        if not request.checkpoint_path.strip():
            raise InvalidArgument("checkpoint_path must name a safetensors checkpoint's directory on the replicas' "
                                  "nodes", reason=Reason.INVALID_ARGUMENT)
        if len(request.checkpoint_path) > 4096:
            raise InvalidArgument(f"checkpoint_path is {len(request.checkpoint_path)} characters long (at most 4096)",
                                  reason=Reason.INVALID_ARGUMENT)
        timeout_s = _weights_call(request)
        if request.on_failure not in weight_sync_pb2.WeightUpdateOnFailure.values():
            raise InvalidArgument(f"unknown on_failure {request.on_failure}", reason=Reason.INVALID_ARGUMENT)
        flip = await self.api.weight_requests.load_weights(
            request.checkpoint_path, request.weight_version if request.HasField("weight_version") else None,
            list(request.replica_ids), rollback=request.on_failure == weight_sync_pb2.WEIGHT_UPDATE_ON_FAILURE_ROLLBACK,
            timeout_s=timeout_s)
        return weight_sync_pb2.LoadWeightsResponse(result=convert.sync_result(flip.outcome), committed=flip.committed,
                                                   rolled_back=flip.rolled_back)

    async def UpdateWeightsFromGroup(self, request: weight_sync_pb2.UpdateWeightsFromGroupRequest,  # noqa: N802
                                     context: grpc.aio.ServicerContext
                                     ) -> weight_sync_pb2.UpdateWeightsFromGroupResponse:
        self._require_weights_caller(context, "UpdateWeightsFromGroup")
        step = request.WhichOneof("step")
        if step is None:
            raise InvalidArgument("set one step: join, receive or leave", reason=Reason.INVALID_ARGUMENT)
        if not request.replica_ids:
            raise InvalidArgument("replica_ids must list the replicas", reason=Reason.EMPTY_REPLICA_IDS)
        if not request.group_name or len(request.group_name) > 200:
            raise InvalidArgument("group_name must be 1 to 200 characters", reason=Reason.INVALID_ARGUMENT)
        body = getattr(request, step)
        if step == "join":
            if not body.master_address or not 0 < body.master_port < 65536:
                raise InvalidArgument("join needs the trainer's master_address and master_port",
                                      reason=Reason.INVALID_ADDRESS)
            if body.rank_offset < 1 or body.rank_offset + len(request.replica_ids) > body.world_size:
                raise InvalidArgument(f"ranks {body.rank_offset}..{body.rank_offset + len(request.replica_ids) - 1} "
                                      f"do not fit world_size {body.world_size} with rank 0 the trainer's",
                                      reason=Reason.INVALID_ARGUMENT)
            if body.backend == weights_pb2.PROCESS_GROUP_BACKEND_UNSPECIFIED:
                raise InvalidArgument("join needs a backend (gloo or nccl)", reason=Reason.INVALID_ARGUMENT)
        if step == "receive":
            if not body.tensors:
                raise InvalidArgument("receive needs the tensors rank 0 broadcasts", reason=Reason.INVALID_ARGUMENT)
            _check_version(body)
        timeout_s = _weights_call(request)
        outcome, committed = await self.api.weight_requests.update_from_group(list(request.replica_ids), request.group_name, step,
                                                               body, timeout_s=timeout_s)
        return weight_sync_pb2.UpdateWeightsFromGroupResponse(result=convert.sync_result(outcome),
                                                              committed=committed)

    # -------------------------------------------------------- events/metrics
    async def WatchEvents(self, request: observability_pb2.WatchEventsRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> AsyncIterator[observability_pb2.WatchEventsResponse]:
        if request.from_sequence > self.api.last_event_sequence + 1:
            from mesh_runtime.errors import OutOfRange  # noqa: PLC0415

            raise OutOfRange(f"from_sequence {request.from_sequence} is ahead of the newest event "
                             f"({self.api.last_event_sequence})", reason=Reason.SEQUENCE_AHEAD)
        replica_ids = set(request.replica_ids)
        types = {events_pb2.EventType.Name(t) for t in request.types}

        def accept(event: LifecycleEvent) -> bool:
            if event.type is EventType.GAP:
                return True
            return ((not replica_ids or not event.replica_id or event.replica_id in replica_ids)
                    and (not types or event.type.proto_name in types))

        async for event in self.api.hub.watch(request.from_sequence, accept, request.include_history):
            yield observability_pb2.WatchEventsResponse(event=convert.event(event))

    async def GetMetrics(self, request: observability_pb2.GetMetricsRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> observability_pb2.GetMetricsResponse:
        metrics = self.api.metrics
        limit = request.limit or 100
        if request.HasField("cycle"):
            cycles = [c for c in metrics.closed if c.cycle == request.cycle]
            if not cycles:
                raise NotFound(f"no closed sync cycle {request.cycle} (closed: "
                               f"{[c.cycle for c in metrics.closed][-5:]})", reason=Reason.CYCLE_NOT_FOUND)
        elif request.HasField("from_cycle"):
            cycles = metrics.cycles(request.from_cycle, limit)
        else:
            cycles = metrics.closed[-1:]
        return observability_pb2.GetMetricsResponse(cycles=[convert.metrics_cycle(c) for c in cycles])


def _check_version(message: weight_sync_pb2.SyncWeightsRequest | weight_sync_pb2.LoadWeightsRequest
                   | weight_sync_pb2.ReceiveTensorsStep) -> None:
    if message.HasField("weight_version") and message.weight_version < 0:
        raise InvalidArgument(f"weight_version must be >= 0, got {message.weight_version}",
                              reason=Reason.INVALID_WEIGHT_VERSION)


def _weights_call(request: weight_sync_pb2.SyncWeightsRequest | weight_sync_pb2.LoadWeightsRequest
                  | weight_sync_pb2.UpdateWeightsFromGroupRequest) -> float | None:
    """Check what the weight RPCs share (version, timeout, replica list); the timeout in seconds."""
    if not isinstance(request, weight_sync_pb2.UpdateWeightsFromGroupRequest):
        _check_version(request)
    timeout_s = None
    if request.HasField("timeout"):
        timeout_s = to_seconds(request.timeout)
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout must be positive, got {timeout_s:g} s", reason=Reason.INVALID_TIMEOUT)
    if len(set(request.replica_ids)) != len(request.replica_ids):
        raise InvalidArgument("replica_ids lists a replica more than once", reason=Reason.DUPLICATE_REPLICA)
    return timeout_s
