"""``rollmesh.weights.v1.WeightSourceService`` over a :class:`~.broadcast.WeightBroadcaster`: the trainer's weights.

Served by the trainer agent beside its own service, and by a trainer process that serves its own weights
(:mod:`.in_process`). Kept apart from the agent's servicer so that such a process imports the broadcast alone.
"""

from __future__ import annotations

import grpc

from mesh_runtime.durations import set_seconds
from mesh_runtime.errors import NotFound
from mesh_runtime.reasons import Reason
from mesh_runtime.server import ServiceBinding
from rollmesh.weights.v1 import weight_source_pb2 as weights_pb
from rollmesh.weights.v1 import weight_source_pb2_grpc
from weight_transfer.wire import DeltaPlan, delta_to_proto, manifest_to_proto, plan_from_proto

from .broadcast import WeightBroadcaster

WEIGHTS_DESCRIPTOR = weights_pb.DESCRIPTOR.services_by_name["WeightSourceService"]


def trainer_member_id(node_id: str) -> str:
    """The trainer's member id in weight-broadcast groups (rank 0, ``plan.source``)."""
    return f"trainer-{node_id}"


class TrainerWeightSource(weight_source_pb2_grpc.WeightSourceServiceServicer):
    """Implements ``WeightSourceService`` for the trainer's one source, member ``member_id`` of its broadcasts."""

    def __init__(self, broadcaster: WeightBroadcaster, member_id: str, timeout_s: float) -> None:
        self.broadcaster = broadcaster
        self.member_id = member_id
        self.timeout_s = timeout_s
        """Bound of a transfer whose plan gives none."""

    def _check_source(self, source_id: str) -> None:
        if source_id and source_id != self.member_id:
            raise NotFound(f"this trainer's one weight source is {self.member_id}, not {source_id[:80]!r} (leave "
                           "source_id empty)", reason=Reason.UNKNOWN_WEIGHT_SOURCE)

    async def PrepareWeightSync(self, request: weights_pb.PrepareWeightSyncRequest,  # noqa: N802 - gRPC method names
                                context: grpc.aio.ServicerContext) -> weights_pb.PrepareWeightSyncResponse:
        self._check_source(request.source_id)
        prepared = await self.broadcaster.prepare(
            request.weight_version,
            bucket_size_bytes=request.bucket_size_bytes if request.HasField("bucket_size_bytes") else None,
            checksum_algorithm=request.checksum_algorithm if request.HasField("checksum_algorithm") else None,
            delta_base_version=request.delta_base_version)
        rendezvous = self.broadcaster.rendezvous
        assert rendezvous is not None   # prepare() started it
        host, port = rendezvous
        out = weights_pb.PrepareWeightSyncResponse(weight_version=prepared.weight_version,
                                                   manifest=manifest_to_proto(prepared.manifest),
                                                   rendezvous_host=host, rendezvous_port=port, source=self.member_id)
        delta = prepared.deltas.get(request.delta_base_version) if request.delta_base_version > 0 else None
        if delta is not None:
            out.delta.CopyFrom(delta_to_proto(DeltaPlan(
                base_version=delta.base_version, base_checksum=delta.base_checksum, stream=delta.manifest,
                changed_words=delta.stats.changed_words, total_words=delta.stats.total_words)))
        return out

    async def SendWeights(self, request: weights_pb.SendWeightsRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> weights_pb.SendWeightsResponse:
        self._check_source(request.source_id)
        sent = await self.broadcaster.send(plan_from_proto(request.plan, self.timeout_s))
        out = weights_pb.SendWeightsResponse(bytes_sent=sent.bytes_sent, checksum=sent.checksum,
                                             weight_version=sent.weight_version)
        set_seconds(out.duration, sent.duration_s)
        return out


def weight_source_binding(broadcaster: WeightBroadcaster, member_id: str, timeout_s: float) -> ServiceBinding:
    """The service, ready for a :class:`~mesh_runtime.server.MeshServer`."""
    return ServiceBinding(WEIGHTS_DESCRIPTOR.full_name, TrainerWeightSource(broadcaster, member_id, timeout_s),
                          weight_source_pb2_grpc.add_WeightSourceServiceServicer_to_server)
