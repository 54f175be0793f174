"""gRPC surface of the trainer agent: decode -> TrainerNode call -> encode."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mesh_runtime.durations import set_seconds
from mesh_runtime.metrics import ServerMetrics
from mesh_runtime.status import StatusReporter
from rollmesh.trainer.v1 import trainer_agent_pb2 as pb
from rollmesh.trainer.v1 import trainer_agent_pb2_grpc

from .config import TrainerAgentConfig
from .node import TrainerNode
from .weight_service import weight_source_binding

if TYPE_CHECKING:
    from mesh_runtime.server import MeshServer

DESCRIPTOR = pb.DESCRIPTOR.services_by_name["TrainerAgentService"]


class TrainerAgentServicer(trainer_agent_pb2_grpc.TrainerAgentServiceServicer):
    """Implements ``rollmesh.trainer.v1.TrainerAgentService``."""

    def __init__(self, config: TrainerAgentConfig, tracer_provider: TracerProvider | None = None) -> None:
        self.node = TrainerNode(config, tracer_provider)
        self.status = StatusReporter(config, ["status", "weights", "progress", "offload"])
        self.metrics = ServerMetrics()
        self.metrics.on_scrape(self._progress_families)
        self.also_serves = [weight_source_binding(self.node.broadcaster, self.node.member_id,
                                                  config.weight_transfer_timeout_s)]

    async def attach(self, server: MeshServer) -> None:
        await self.node.start(server)

    def _progress_families(self) -> list:
        p = self.node.driver.progress()
        out: list[GaugeMetricFamily | CounterMetricFamily] = [GaugeMetricFamily("rollmesh_trainer_global_step", "Training steps finished", value=p.global_step),
               GaugeMetricFamily("rollmesh_trainer_weight_version", "Weight version of the trainer's weights",
                                 value=p.weight_version),
               GaugeMetricFamily("rollmesh_trainer_queue_samples", "Samples waiting in the message queue",
                                 value=p.queue_size)]
        loop = self.node.driver.loop
        if loop is not None:
            out.append(GaugeMetricFamily("rollmesh_trainer_queue_capacity_samples",
                                         "Bound of the message queue in samples", value=loop.queue.max_queue_size))
        for name, value, text in (("generated", p.samples_generated, "Samples the rollouter generated"),
                                  ("consumed", p.samples_consumed, "Samples training consumed"),
                                  ("dropped", p.samples_dropped, "Samples dropped as too stale")):
            family = CounterMetricFamily(f"rollmesh_trainer_samples_{name}", text)
            family.add_metric([], value)
            out.append(family)
        state = GaugeMetricFamily("rollmesh_trainer_state", "1 for the training loop's current state",
                                  labels=["state"])
        state.add_metric([p.state], 1)
        out.append(state)
        return out

    async def GetStatus(self, request: pb.GetStatusRequest,  # noqa: N802 - gRPC method names
                        context: grpc.aio.ServicerContext) -> pb.GetStatusResponse:
        node = self.node
        return pb.GetStatusResponse(status=self.status.status(), rank=node.rank, world_size=node.world_size,
                                    model=node.config.model, training_backend=node.source.backend,
                                    weight_rendezvous_address=node.broadcaster.rendezvous_address)

    async def GetTrainingProgress(self, request: pb.GetTrainingProgressRequest,  # noqa: N802
                                  context: grpc.aio.ServicerContext) -> pb.GetTrainingProgressResponse:
        p = self.node.driver.progress()
        out = pb.GetTrainingProgressResponse(
            global_step=p.global_step, weight_version=p.weight_version, param_version=p.param_version,
            samples_generated=p.samples_generated, samples_consumed=p.samples_consumed,
            samples_dropped=p.samples_dropped, queue_size=p.queue_size,
            state=pb.TrainingState.Value(f"TRAINING_STATE_{p.state}"), error_message=p.error_message,
            final_step=p.final_step)
        if p.last_reward_mean is not None:
            out.last_reward_mean = p.last_reward_mean
        return out

    async def StopTraining(self, request: pb.StopTrainingRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.StopTrainingResponse:
        final = self.node.driver.stop(request.after_step if request.HasField("after_step") else None)
        return pb.StopTrainingResponse(final_step=final)

    async def OffloadTrainingState(self, request: pb.OffloadTrainingStateRequest,  # noqa: N802
                                   context: grpc.aio.ServicerContext) -> pb.OffloadTrainingStateResponse:
        moved = await self.node.driver.offload(request.include_optimizer)
        out = pb.OffloadTrainingStateResponse(bytes_moved=moved.bytes_moved)
        set_seconds(out.duration, moved.duration_s)
        return out

    async def OnloadTrainingState(self, request: pb.OnloadTrainingStateRequest,  # noqa: N802
                                  context: grpc.aio.ServicerContext) -> pb.OnloadTrainingStateResponse:
        moved = await self.node.driver.onload()
        out = pb.OnloadTrainingStateResponse(bytes_moved=moved.bytes_moved)
        set_seconds(out.duration, moved.duration_s)
        return out
