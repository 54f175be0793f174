"""gRPC surface of the replica agent: decode -> domain call -> encode."""

from __future__ import annotations

from mesh_runtime.capabilities import pending
from mesh_runtime.status import StatusReporter, node_name
from rollmesh.replica.v1 import replica_agent_pb2, replica_agent_pb2_grpc

from .config import ReplicaAgentConfig

DESCRIPTOR = replica_agent_pb2.DESCRIPTOR.services_by_name["ReplicaAgentService"]


@pending(DESCRIPTOR, {
    "lifecycle": ["LaunchReplica", "StopReplica", "ListReplicas", "GetReplica"],
    "generate": ["Generate", "AbortRequests", "PauseGeneration", "ResumeGeneration"],
    "sleep": ["Sleep", "WakeUp"],
    "weights": ["ReceiveWeights", "SendWeights"],
    "load_reports": ["GetLoadReports"],
})
class ReplicaAgentServicer(replica_agent_pb2_grpc.ReplicaAgentServiceServicer):
    """Implements ``rollmesh.replica.v1.ReplicaAgentService``."""

    def __init__(self, config: ReplicaAgentConfig) -> None:
        self.config = config
        self.status = StatusReporter(config, ["status"])

    async def GetStatus(self, request, context):  # noqa: N802 - gRPC method name
        return replica_agent_pb2.GetStatusResponse(status=self.status.status(),
                                                   node_id=node_name(self.config.node_id))
