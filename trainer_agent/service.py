"""gRPC surface of the trainer agent: decode -> domain call -> encode."""

from __future__ import annotations

from mesh_runtime.capabilities import pending
from mesh_runtime.status import StatusReporter
from rollmesh.trainer.v1 import trainer_agent_pb2, trainer_agent_pb2_grpc

from .config import TrainerAgentConfig

DESCRIPTOR = trainer_agent_pb2.DESCRIPTOR.services_by_name["TrainerAgentService"]


@pending(DESCRIPTOR, {
    "weights": ["SendWeights"],
    "progress": ["GetTrainingProgress"],
    "offload": ["OffloadTrainingState", "OnloadTrainingState"],
})
class TrainerAgentServicer(trainer_agent_pb2_grpc.TrainerAgentServiceServicer):
    """Implements ``rollmesh.trainer.v1.TrainerAgentService``."""

    def __init__(self, config: TrainerAgentConfig) -> None:
        self.status = StatusReporter(config, ["status"])

    async def GetStatus(self, request, context):  # noqa: N802 - gRPC method name
        return trainer_agent_pb2.GetStatusResponse(status=self.status.status())
