"""gRPC surface of the controller: decode -> domain call -> encode."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider

from mesh_runtime.capabilities import pending
from mesh_runtime.server import MeshServer
from mesh_runtime.status import StatusReporter
from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc

from .config import ControllerConfig
from .peers import Peers

DESCRIPTOR = controller_pb2.DESCRIPTOR.services_by_name["ControllerService"]


@pending(DESCRIPTOR, {
    "registry": ["RegisterNode", "DeregisterNode", "StreamLoadReports", "ListNodes", "GetNode",
                 "ListReplicas", "GetReplica"],
    "scheduling": ["BeginTrainingStep", "ReleaseHybridReplicas", "CompleteTrainingStep",
                   "GetSchedulerState"],
    "weight_sync": ["SyncWeights"],
    "events": ["WatchEvents"],
    "metrics": ["GetMetrics"],
    "scaling": ["ScaleOut", "ScaleIn", "GetOperation", "ListOperations", "CancelOperation",
                "CancelOperations"],
    "autoscaler": ["GetAutoscalerStatus", "SetAutoscalerEnabled", "GetAutoscalerConditions",
                   "ListScaleHistory"],
})
class ControllerServicer(controller_pb2_grpc.ControllerServiceServicer):
    """Implements ``rollmesh.controller.v1.ControllerService``."""

    def __init__(self, config: ControllerConfig, tracer_provider: TracerProvider | None) -> None:
        self.status = StatusReporter(config, ["status"])
        self.peers = Peers(load_balancer_address=config.load_balancer_address,
                           timeout_s=config.peer_timeout_s, tracer_provider=tracer_provider)

    async def attach(self, server: MeshServer) -> None:
        server.add_cleanup(self.peers.close)

    async def GetStatus(self, request, context):  # noqa: N802 - gRPC method name
        return controller_pb2.GetStatusResponse(status=self.status.status(), peers=await self.peers.probe())
