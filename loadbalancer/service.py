"""gRPC surface of the load balancer: decode -> domain call -> encode."""

from __future__ import annotations

from mesh_runtime.capabilities import pending
from mesh_runtime.status import StatusReporter
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc

from .config import LoadBalancerConfig

DESCRIPTOR = loadbalancer_pb2.DESCRIPTOR.services_by_name["LoadBalancerService"]


@pending(DESCRIPTOR, {
    "generate": ["Generate"],
    "replicas": ["AddReplicas", "RemoveReplicas", "UpdateReplicas", "ListReplicas"],
    "rebalance": ["ClearStickySessions", "Rebalance"],
    "stats": ["GetStats"],
})
class LoadBalancerServicer(loadbalancer_pb2_grpc.LoadBalancerServiceServicer):
    """Implements ``rollmesh.loadbalancer.v1.LoadBalancerService``."""

    def __init__(self, config: LoadBalancerConfig) -> None:
        self.status = StatusReporter(config, ["status"])

    async def GetStatus(self, request, context):  # noqa: N802 - gRPC method name
        return loadbalancer_pb2.GetStatusResponse(status=self.status.status())
