"""gRPC surface of the load balancer: decode -> Balancer call -> encode."""

from __future__ import annotations

from collections.abc import AsyncIterator
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry.sdk.trace import TracerProvider

from mesh_runtime import __version__, pages, tracing
from mesh_runtime.durations import set_seconds
from mesh_runtime.metrics import ServerMetrics
from mesh_runtime.multiplex import Multiplexer
from mesh_runtime.status import StatusReporter
from mesh_runtime.validate import check_address, check_id
from rollmesh.common.v1 import types_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc, routing_pb2

from .balancer import Balancer
from .config import LoadBalancerConfig
from .kv_reports import CapacityReports
from .prefix_events import PrefixWatchers
from . import routing
from .table import OutlierDetection, Route, RoutingTable
from .upstreams import Upstreams

if TYPE_CHECKING:
    from mesh_runtime.server import MeshServer
    from .controller_link import BalancerLink
    from .fronts.openai_front import OpenAIFront

log = logging.getLogger(__name__)
DESCRIPTOR = pb.DESCRIPTOR.services_by_name["LoadBalancerService"]
KINDS = {types_pb2.REPLICA_KIND_STANDALONE: "STANDALONE", types_pb2.REPLICA_KIND_HYBRID: "HYBRID",
         types_pb2.REPLICA_KIND_UNSPECIFIED: "STANDALONE"}
KIND_VALUES = {"STANDALONE": types_pb2.REPLICA_KIND_STANDALONE, "HYBRID": types_pb2.REPLICA_KIND_HYBRID}


def build_balancer(config: LoadBalancerConfig, tracer_provider: TracerProvider | None, **kwargs: Any) -> Balancer:
    od = config.outlier_detection
    table = RoutingTable(routing.selectors(config), max_version_lag=config.max_version_lag,
                         outlier=OutlierDetection(od.consecutive_failures, od.base_ejection_s, od.max_ejection_s,
                                                  od.max_ejection_percent))
    table.add(Route(r.replica_id, r.address, r.kind, r.weight_version) for r in config.replicas)
    upstreams = Upstreams(tracer_provider=tracer_provider, call_timeout_s=config.upstream_call_timeout_s,
                          tls=config.tls, agent_streams=config.agent_streams)
    return Balancer(config, table, upstreams, tracer=tracing.tracer(tracer_provider, "rollmesh.loadbalancer"),
                    **kwargs)


def own_name(config: LoadBalancerConfig) -> str:
    """The name this balancer's certificate gives it (spiffe://rollmesh/lb/NAME); empty without mutual TLS."""
    from mesh_runtime.identity import identity_from_pem  # noqa: PLC0415

    tls = config.tls
    if tls is None or not tls.cert:
        return ""
    with open(tls.cert, "rb") as f:
        identity = identity_from_pem(f.read())
    return identity.name if identity is not None else ""


class LoadBalancerServicer(loadbalancer_pb2_grpc.LoadBalancerServiceServicer):
    """Implements ``rollmesh.loadbalancer.v1.LoadBalancerService``."""

    def __init__(self, config: LoadBalancerConfig, tracer_provider: TracerProvider | None = None,
                 **balancer_kwargs: Any) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.balancer = build_balancer(config, tracer_provider, metrics=self.metrics, **balancer_kwargs)
        self.table = self.balancer.table
        self.metrics.on_scrape(lambda: self.balancer.stats.families(
            self.balancer.in_flight, self.balancer.completed,
            [not self.table.unroutable_reason(r) for r in self.table.routes.values()],
            self.table.sticky_sessions))
        self.status = StatusReporter(config, ["status", "generate", "generate_many", "replicas", "rebalance",
                                                      "stats", "sessions"])
        self._rebalances: OrderedDict[str, pb.RebalanceResponse] = OrderedDict()
        self.http: OpenAIFront | None = None
        """The OpenAI-compatible HTTP API (``http_listen``), once started."""
        self.link: BalancerLink | None = None
        """The registration with the controller (``controller_address``), once attached."""
        self.controller_channel: grpc.aio.Channel | None = None
        """The channel to the controller (``controller_address``), once attached."""
        self.prefix_watchers: PrefixWatchers | None = None
        """The replicas' prefix-cache event streams (``prefix_routing.kv_events``), once attached."""
        self.capacity_reports: CapacityReports | None = None
        """The replicas' KV capacity for program admission (``program_admission`` with ``kv_tokens`` 0)."""

    async def attach(self, server: MeshServer) -> None:
        server.add_cleanup(self.balancer.upstreams.close)
        if self.table.prefix is not None and self.config.prefix_routing.kv_events:
            self.prefix_watchers = PrefixWatchers(self.table, self.balancer.upstreams.stub)
            await self.prefix_watchers.start()
            server.add_cleanup(self.prefix_watchers.close)
        pa = self.config.program_admission
        if self.balancer.programs is not None and not pa.kv_tokens:
            self.capacity_reports = CapacityReports(self.table, self.balancer.programs, self.balancer.upstreams.stub,
                                                    interval_s=pa.report_interval_s,
                                                    call_timeout_s=self.config.upstream_call_timeout_s)
            await self.capacity_reports.start()
            server.add_cleanup(self.capacity_reports.close)
        if self.config.controller_address:
            from mesh_runtime.channels import open_channel  # noqa: PLC0415

            from .controller_link import BalancerLink  # noqa: PLC0415, F811 - imported here at run time

            config = self.config
            address = config.advertise_address or server.address
            channel = open_channel(config.controller_address, tls=config.tls)
            server.add_cleanup(channel.close)
            self.controller_channel = channel
            self.link = link = BalancerLink(channel, balancer_id=config.balancer_id or own_name(config) or address,
                                     address=address, version=__version__)
            server.add_cleanup(link.deregister)   # cleanups run in reverse: before the channel closes
            server.spawn(link.run(), name="controller-link")
        if self.config.http_listen:
            from mesh_runtime.chat import ChatError, ChatTokenizer  # noqa: PLC0415
            from mesh_runtime.config import ConfigError  # noqa: PLC0415

            from .fronts.openai_front import OpenAIFront  # noqa: PLC0415 - aiohttp only where the API is on

            try:
                tokenizer = ChatTokenizer.from_model(self.config.model)
            except ChatError as err:
                raise ConfigError("model", str(err)) from None
            self.http = OpenAIFront(self.config, self.balancer, tokenizer, controller=self.controller_channel)
            await self.http.start()
            server.add_cleanup(self.http.close)

    def _routed(self, route: Route) -> routing_pb2.RoutedReplica:
        reason = self.table.unroutable_reason(route)
        msg = routing_pb2.RoutedReplica(
            endpoint=routing_pb2.ReplicaEndpoint(replica_id=route.replica_id, address=route.address,
                                                 kind=KIND_VALUES[route.kind], weight_version=route.weight_version,
                                                 node_id=route.node_id),
            in_flight=route.in_flight, sticky_sessions=self.table.sticky_count(route.replica_id),
            completed=route.completed, failed=route.failed, routable=not reason, unroutable_reason=reason,
            consecutive_failures=route.breaker.consecutive_failures, ejections=route.breaker.ejections)
        set_seconds(msg.added_at, route.added_at)
        left = route.breaker.ejected_until - self.table.clock()
        if left > 0:
            set_seconds(msg.ejected_until, time.time() + left)
        return msg

    async def GetStatus(self, request: pb.GetStatusRequest,  # noqa: N802 - gRPC method names throughout
                        context: grpc.aio.ServicerContext) -> pb.GetStatusResponse:
        return pb.GetStatusResponse(status=self.status.status(), replica_count=len(self.table.routes),
                                    routable_replica_count=len(self.table.eligible(None)),
                                    in_flight=self.balancer.in_flight)

    async def Generate(self, request: pb.GenerateRequest,  # type: ignore[override]  # noqa: N802
                       context: grpc.aio.ServicerContext) -> None:
        # gRPC's writer API (a coroutine calling context.write) in place of an async generator: the request
        # runs in the call's own task, with no generator, task or queue between its attempts and the caller.
        await self.balancer.serve(request, context.time_remaining(), context.write)

    async def GenerateMany(self, request_iterator: AsyncIterator[pb.GenerateManyRequest],  # noqa: N802
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateManyResponse]:
        multiplexer = Multiplexer(self.balancer.generate, item=pb.GenerateManyItem, response=pb.GenerateManyResponse)
        async for response in multiplexer.serve(request_iterator):
            yield response

    async def AddReplicas(self, request: pb.AddReplicasRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> pb.AddReplicasResponse:
        for index, e in enumerate(request.replicas):   # validate everything before changing anything
            check_id(e.replica_id, f"replicas[{index}].replica_id")
            if e.node_id:
                check_id(e.node_id, f"replicas[{index}].node_id")
            check_address(e.address, f"replicas[{index}].address")
        routes = [Route(e.replica_id, e.address, KINDS[e.kind], e.weight_version, e.node_id)
                  for e in request.replicas]
        added = self.table.add(routes)
        return pb.AddReplicasResponse(replicas=[self._routed(r) for r in added])

    async def RemoveReplicas(self, request: pb.RemoveReplicasRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.RemoveReplicasResponse:
        removed, dropped, in_flight = await self.balancer.control.remove(list(request.replica_ids),
                                                                 request.abort_in_flight)
        return pb.RemoveReplicasResponse(removed_replica_ids=removed, dropped_sticky_sessions=dropped,
                                         in_flight_request_ids=in_flight)

    async def UpdateReplicas(self, request: pb.UpdateReplicasRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.UpdateReplicasResponse:
        for update in request.updates:  # validate everything before changing anything
            if update.HasField("address"):
                check_address(update.address, f"replica {update.replica_id!r} address")
            if not (request.skip_unknown and update.replica_id not in self.table.routes):
                self.table.get(update.replica_id)
        skipped = [u.replica_id for u in request.updates if u.replica_id not in self.table.routes]
        routes = [self.table.update(u.replica_id,
                                    weight_version=u.weight_version if u.HasField("weight_version") else None,
                                    address=u.address if u.HasField("address") else None)
                  for u in request.updates if u.replica_id in self.table.routes]
        return pb.UpdateReplicasResponse(replicas=[self._routed(r) for r in routes], skipped_replica_ids=skipped)

    async def ListReplicas(self, request: pb.ListReplicasRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.ListReplicasResponse:
        kinds = {KINDS[k] for k in request.kinds}
        routed = [self._routed(r) for r in sorted(self.table.routes.values(), key=lambda r: r.replica_id)
                  if not kinds or r.kind in kinds]
        matching = [r for r in routed if r.routable or not request.routable_only]
        chosen, token = pages.page(matching, key=lambda r: r.endpoint.replica_id, page_size=request.page_size,
                                   page_token=request.page_token, filters=(sorted(kinds), request.routable_only))
        return pb.ListReplicasResponse(replicas=chosen, next_page_token=token)

    async def ClearStickySessions(self, request: pb.ClearStickySessionsRequest,  # noqa: N802
                                  context: grpc.aio.ServicerContext) -> pb.ClearStickySessionsResponse:
        return pb.ClearStickySessionsResponse(cleared_sessions=self.table.clear_sticky(request.replica_ids))

    async def CloseSession(self, request: pb.CloseSessionRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.CloseSessionResponse:
        replica_id, released = await self.balancer.control.close_session(request.session_id)
        return pb.CloseSessionResponse(replica_id=replica_id, released=released)

    async def Rebalance(self, request: pb.RebalanceRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> pb.RebalanceResponse:
        if request.request_id and request.request_id in self._rebalances:
            return self._rebalances[request.request_id]
        moved, counts = await self.balancer.control.rebalance(request.max_moves if request.HasField("max_moves") else None)
        reply = pb.RebalanceResponse(moved_request_ids=moved, replicas=[
            pb.ReplicaInFlight(replica_id=rid, in_flight_before=b, in_flight_after=a) for rid, (b, a) in counts.items()])
        if request.request_id:
            self._rebalances[request.request_id] = reply
            while len(self._rebalances) > 256:
                self._rebalances.popitem(last=False)
        return reply

    async def GetStats(self, request: pb.GetStatsRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        return pb.GetStatsResponse(stats=self.balancer.stats.to_proto(self.balancer.in_flight))
